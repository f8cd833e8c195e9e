//! pare: a transparent compaction proxy for OpenAI-, Anthropic- and Gemini-compatible model endpoints.
//!
//! An agent points its base URL at pare. Every `POST …/chat/completions`, `…/responses`,
//! `…/v1/messages` and `…/models/M:generateContent` is archived exactly as sent, its conversation is compacted by a deterministic rule
//! set (no model is called), the slimmed request is forwarded upstream and the answer streams back
//! unchanged. Everything else passes through.
//!
//! # Layout
//!
//! - [`neutral`]: the wire-neutral conversation the engine reads (chat-shaped messages, tool calls
//!   paired with their results by id, opaque parts), with the body scanner and the fast message read.
//! - [`wire`]: one adapter per request format (Chat Completions, Responses, Anthropic Messages,
//!   Gemini) that parses a body once into the neutral form and writes the forwarded body back.
//! - [`compact`]: the pure engine — rules, markers, structural maps, salience tiers, elision and
//!   pairing validation — with no socket, no clock and no failure on user data; it returns the
//!   forwarded prefix and its plan (what became of each message).
//! - [`tokens`]: token counts per message (o200k / cl100k), cached by content hash.
//! - [`budget`]: context windows and the per-session epoch state machine that decides
//!   when and how much to compact and keeps forwarded prompts append-only between epochs.
//! - [`session`]: which conversation a request belongs to (explicit header, or prefix match).
//! - [`memory`]: one byte budget for all per-session state, evicting least recently used sessions.
//! - [`archive`]: the durable raw store (SQLite, or PostgreSQL for a fleet), its integrity chain, the
//!   stored plans sessions resume from, audit queries and DPO/SFT export.
//! - [`pipeline`]: the seam the proxy calls for one request: session, window, compaction, archive.
//! - [`observe`]: mode `observe`, what epoch mode would have forwarded, projected beside the traffic.
//! - [`exchange`]: the leaf types the proxy, pipeline, budget and archive share about one exchange.
//! - [`outbound`]: the one way pare builds an outgoing HTTP client (upstream, window detection).
//! - [`proxy`]: the HTTP shell — server, upstream client, streaming, errors, pare's own endpoints.
//! - [`ui`]: the read-only audit UI under `/_pare/ui/`, server-rendered pages over the archive.
//! - [`config`]: the YAML configuration, its defaults, and validation that reports every problem.
//! - [`cli`]: the command line (`serve`, `ui`, `compact`, `replay`, `eval`, `sessions`, `export`,
//!   `check`, `archive`).
//! - [`eval`]: the evaluation harness, apart from the product: the metrics of MISSION.md over a corpus
//!   of sessions, the sessions it reads and their tune/holdout split (`corpus`), the peers' strategies
//!   (`strategy`).

pub mod archive;
pub mod budget;
pub mod cli;
pub mod compact;
pub mod config;
pub mod eval;
pub mod exchange;
pub mod memory;
pub mod neutral;
pub mod observe;
pub mod outbound;
pub mod pipeline;
pub mod proxy;
pub mod session;
pub mod tokens;
pub mod ui;
pub mod wire;

/// The global allocator of the `pare` binary and of the benchmarks that measure it: mimalloc (cargo
/// feature `mimalloc`, on by default; without it, the system allocator). pare's work is many
/// short-lived strings — a large request's messages, decoded texts, markers — allocated and freed on
/// the rayon pool and on tokio's threads: on the engine bench's request mimalloc cut the engine's
/// instructions from 41.2 M to 38.0 M and its time on one thread by about a fifth against glibc's
/// malloc (BENCHMARKS.md, *Allocator*). A library user keeps their own allocator: this is only a name to
/// put in a `#[global_allocator]` static.
#[cfg(feature = "mimalloc")]
pub use mimalloc::MiMalloc as Allocator;
#[cfg(not(feature = "mimalloc"))]
pub use std::alloc::System as Allocator;

/// mimalloc v3's `mi_option_purge_delay` (its index in the option enum of `libmimalloc-sys` 0.1.49,
/// pinned; the crate names no constant for it).
#[cfg(feature = "mimalloc")]
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Tune [`Allocator`] for a proxy whose working memory comes and goes with each request (BENCHMARKS.md,
/// *Memory*). The binary calls it first thing.
/// - mimalloc's `purge_delay` 0 instead of 1 s, unless `MIMALLOC_PURGE_DELAY` is set: freed memory
///   goes back to the system at once, so resident memory comes back down after a burst of large
///   requests.
/// - No transparent huge pages for the process (`prctl(PR_SET_THP_DISABLE)`, Linux), unless
///   `MIMALLOC_ALLOW_THP` is set: mimalloc asks for them on its arenas (`madvise`), and then every
///   fresh 2 MiB of the heap is a page fault that zeroes 2 MiB, again after each purge. On a replay
///   of real sessions that was ≈ 40 % of pare's CPU time, and resident memory held the huge pages'
///   unused parts. mimalloc's own option (`MIMALLOC_ALLOW_THP=0`) does the same but only when set
///   before the process starts: its first arena is mapped before `main`.
pub fn tune_allocator() {
    #[cfg(feature = "mimalloc")]
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        // SAFETY: sets one of mimalloc's integer options; safe from any thread at any time.
        unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, 0) };
    }
    #[cfg(target_os = "linux")]
    if std::env::var_os("MIMALLOC_ALLOW_THP").is_none() {
        disable_transparent_huge_pages();
    }
}

/// Make the calling thread a batch thread (Linux `SCHED_BATCH`), for a background thread that
/// requests hand work to (the counting thread). Waking it never preempts the thread that woke it —
/// a request still on its way to the upstream — and under load it keeps its full share of the CPU,
/// which a lower priority would cut (BENCHMARKS.md, *Memory, real sessions and the binary*). Best
/// effort: an error leaves the thread as it was.
pub fn batch_thread() {
    #[cfg(target_os = "linux")]
    {
        const SCHED_BATCH: std::ffi::c_int = 3;
        #[repr(C)]
        struct SchedParam {
            sched_priority: std::ffi::c_int,
        }
        unsafe extern "C" {
            fn sched_setscheduler(
                pid: std::ffi::c_int,
                policy: std::ffi::c_int,
                param: *const SchedParam,
            ) -> std::ffi::c_int;
        }
        // SAFETY: pid 0 is the calling thread; SCHED_BATCH takes priority 0 and changes only how the
        // scheduler treats this thread.
        let _ = unsafe { sched_setscheduler(0, SCHED_BATCH, &SchedParam { sched_priority: 0 }) };
    }
}

/// `prctl(PR_SET_THP_DISABLE, 1)`: no transparent huge page for this process from here on (what the
/// kernel checks at each fault, so the mappings made before count too). Best effort: an error leaves
/// them allowed.
#[cfg(target_os = "linux")]
fn disable_transparent_huge_pages() {
    const PR_SET_THP_DISABLE: std::ffi::c_int = 41;
    unsafe extern "C" {
        fn prctl(option: std::ffi::c_int, ...) -> std::ffi::c_int;
    }
    // SAFETY: prctl with PR_SET_THP_DISABLE takes an unsigned long flag and ignores the other
    // arguments; it changes no memory of this process.
    let _ = unsafe {
        prctl(
            PR_SET_THP_DISABLE,
            1 as std::ffi::c_ulong,
            0 as std::ffi::c_ulong,
            0 as std::ffi::c_ulong,
            0 as std::ffi::c_ulong,
        )
    };
}

#[cfg(all(test, feature = "mimalloc"))]
mod allocator_tests {
    /// The pinned index still names the purge delay: its documented default is 1000 ms (read
    /// before any test could change it, the environment not setting it).
    #[test]
    fn the_purge_delay_option_index_is_mimallocs() {
        if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
            // SAFETY: reads an option.
            let delay = unsafe { libmimalloc_sys::mi_option_get(super::MI_OPTION_PURGE_DELAY) };
            assert_eq!(delay, 1000);
        }
    }
}

#[cfg(all(test, target_os = "linux"))]
mod huge_page_tests {
    /// After the call the kernel reports transparent huge pages off for this process (`THP_enabled`
    /// in `/proc/self/status`; the test process keeps the setting, which is harmless).
    #[test]
    fn transparent_huge_pages_are_turned_off() {
        super::disable_transparent_huge_pages();
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let line = status.lines().find(|l| l.starts_with("THP_enabled:")).expect("THP_enabled in /proc/self/status");
        assert_eq!(line.split_whitespace().nth(1), Some("0"), "{line}");
    }
}
