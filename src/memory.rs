//! One memory budget in bytes (`memory.max_state_bytes`) for everything pare keeps per session: the
//! session tracker's keys, the compactor's frozen prefixes and arrival times, the archive writer's
//! cursors (per message of the last bodies, what the next body is a delta against: a blob id and a
//! digest, never the bytes), and the fixed-size caches of token counts and
//! message keys, whose full capacity is reserved up front.
//!
//! Each holder says, after changing what it keeps for a session, how many bytes that now is
//! ([`StateBudget::charge`]); the session becomes the most recently used. While the total is over the
//! budget the least recently used *whole* sessions are evicted: the ledger forgets them at once and
//! each holder that kept something for them finds them in its eviction list
//! ([`StateBudget::take_evicted`]) the next time it runs, under its own lock, and drops them. The
//! ledger never calls into a holder, so holders may charge while holding their own locks.
//!
//! An evicted session that comes back is rebuilt from the archive, as after a restart (the tracker
//! finds it by its stored answer keys, the compactor resumes its frozen prefix from the stored
//! plan, the writer reloads its cursor), so forwarding is the same as if it had stayed; without an
//! archive it starts afresh.

use std::sync::Mutex;

use lru::LruCache;

/// Default budget: 256 MiB.
pub const DEFAULT_MAX_STATE_BYTES: u64 = 256 * 1024 * 1024;

/// Bytes of bookkeeping counted for a session in the ledger and in each holder's maps (its id, the
/// map entries), on top of what the holders charge.
pub const SESSION_OVERHEAD_BYTES: u64 = 256;

/// Who keeps state for a session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Holder {
    /// [`crate::session::SessionTracker`]: ext keys, pending requests.
    Tracker = 0,
    /// [`crate::budget::compactor::SessionCompactor`]: the frozen prefix, arrival times.
    Compactor = 1,
    /// The archive writer's cursor: per message of the session's last raw and forwarded lists, its
    /// blob id, separator and digest.
    Archive = 2,
}

const N_HOLDERS: usize = 3;

/// What `/_pare/health` and `/_pare/metrics` show.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct BudgetStats {
    /// Bytes accounted now: per-session state plus the caches' reservations.
    pub held_bytes: u64,
    pub max_bytes: u64,
    /// Of `held_bytes`, what the fixed-size caches reserve.
    pub reserved_bytes: u64,
    /// Sessions with state in memory.
    pub sessions: u64,
    /// Sessions evicted since start.
    pub evictions: u64,
    /// Of `held_bytes`, what each holder keeps for its sessions.
    pub by_holder: HeldBy,
}

/// Per-session bytes held, by holder.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct HeldBy {
    pub tracker: u64,
    pub compactor: u64,
    pub archive: u64,
}

struct Ledger {
    /// Bytes each holder keeps per session, least recently used first.
    sessions: LruCache<String, [u64; N_HOLDERS]>,
    session_bytes: u64,
    /// Of `session_bytes`, each holder's part (the per-session overhead aside).
    holder_bytes: [u64; N_HOLDERS],
    reserved: u64,
    /// Sessions each holder must drop.
    evicted: [Vec<String>; N_HOLDERS],
    n_evictions: u64,
}

/// The byte budget shared by the tracker, the compactor and the archive writer.
pub struct StateBudget {
    max_bytes: u64,
    ledger: Mutex<Ledger>,
}

impl std::fmt::Debug for StateBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StateBudget").field("stats", &self.stats()).finish()
    }
}

impl StateBudget {
    pub fn new(max_bytes: u64) -> StateBudget {
        StateBudget {
            max_bytes,
            ledger: Mutex::new(Ledger {
                sessions: LruCache::unbounded(),
                session_bytes: 0,
                holder_bytes: [0; N_HOLDERS],
                reserved: 0,
                evicted: Default::default(),
                n_evictions: 0,
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Ledger> {
        // The ledger is consistent after every statement that can panic: keep using it.
        self.ledger.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Reserve `bytes` for a fixed-size cache for as long as pare runs (its full capacity).
    pub fn reserve(&self, bytes: u64) {
        self.lock().reserved += bytes;
    }

    /// `holder` now keeps `bytes` for `session`, which becomes the most recently used. Evicts the
    /// least recently used other sessions while the total is over the budget.
    pub fn charge(&self, holder: Holder, session: &str, bytes: u64) {
        let mut ledger = self.lock();
        let ledger = &mut *ledger;
        let held = match ledger.sessions.get_mut(session) {
            Some(held) => held,
            None => {
                ledger.session_bytes += SESSION_OVERHEAD_BYTES;
                ledger.sessions.push(session.to_owned(), [0; N_HOLDERS]);
                ledger.sessions.get_mut(session).expect("just pushed")
            }
        };
        ledger.session_bytes = ledger.session_bytes - held[holder as usize] + bytes;
        ledger.holder_bytes[holder as usize] = ledger.holder_bytes[holder as usize] - held[holder as usize] + bytes;
        held[holder as usize] = bytes;
        while ledger.session_bytes + ledger.reserved > self.max_bytes && ledger.sessions.len() > 1 {
            let Some((evicted, held)) = ledger.sessions.pop_lru() else { break };
            ledger.session_bytes -= held.iter().sum::<u64>() + SESSION_OVERHEAD_BYTES;
            ledger.n_evictions += 1;
            for (idx, bytes) in held.iter().enumerate() {
                ledger.holder_bytes[idx] -= bytes;
                if *bytes > 0 {
                    ledger.evicted[idx].push(evicted.clone());
                }
            }
        }
    }

    /// `holder` keeps nothing more for `session` (it dropped it on its own).
    pub fn release(&self, holder: Holder, session: &str) {
        let mut ledger = self.lock();
        let ledger = &mut *ledger;
        if let Some(held) = ledger.sessions.peek_mut(session) {
            let bytes = std::mem::take(&mut held[holder as usize]);
            ledger.session_bytes -= bytes;
            ledger.holder_bytes[holder as usize] -= bytes;
            if held.iter().all(|b| *b == 0) {
                ledger.sessions.pop(session);
                ledger.session_bytes -= SESSION_OVERHEAD_BYTES;
            }
        }
    }

    /// Sessions evicted since `holder` last asked: it drops what it keeps for them.
    pub fn take_evicted(&self, holder: Holder) -> Vec<String> {
        let mut ledger = self.lock();
        if ledger.evicted[holder as usize].is_empty() {
            return Vec::new();
        }
        std::mem::take(&mut ledger.evicted[holder as usize])
    }

    /// Whether `holder` keeps state for `session` (as far as the ledger knows).
    pub fn holds(&self, holder: Holder, session: &str) -> bool {
        self.lock().sessions.peek(session).is_some_and(|held| held[holder as usize] > 0)
    }

    pub fn stats(&self) -> BudgetStats {
        let ledger = self.lock();
        BudgetStats {
            held_bytes: ledger.session_bytes + ledger.reserved,
            max_bytes: self.max_bytes,
            reserved_bytes: ledger.reserved,
            sessions: ledger.sessions.len() as u64,
            evictions: ledger.n_evictions,
            by_holder: HeldBy {
                tracker: ledger.holder_bytes[Holder::Tracker as usize],
                compactor: ledger.holder_bytes[Holder::Compactor as usize],
                archive: ledger.holder_bytes[Holder::Archive as usize],
            },
        }
    }
}

impl Default for StateBudget {
    fn default() -> Self {
        StateBudget::new(DEFAULT_MAX_STATE_BYTES)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn least_recently_used_whole_sessions_are_evicted_and_each_holder_is_told() {
        let budget = StateBudget::new(3 * 1000 + 3 * SESSION_OVERHEAD_BYTES);
        budget.charge(Holder::Tracker, "a", 400);
        budget.charge(Holder::Compactor, "a", 600);
        budget.charge(Holder::Tracker, "b", 1000);
        budget.charge(Holder::Archive, "c", 1000);
        assert_eq!(budget.stats().evictions, 0);
        // "a" is used again: "b" is now the least recently used.
        budget.charge(Holder::Compactor, "a", 600);
        budget.charge(Holder::Archive, "d", 10);
        assert_eq!(budget.take_evicted(Holder::Tracker), vec!["b".to_owned()]);
        assert!(budget.take_evicted(Holder::Compactor).is_empty());
        assert!(budget.take_evicted(Holder::Tracker).is_empty(), "told once");
        // Growing "d" evicts "a" (both holders) and then "c".
        budget.charge(Holder::Archive, "d", 2500);
        assert_eq!(budget.take_evicted(Holder::Tracker), vec!["a".to_owned()]);
        assert_eq!(budget.take_evicted(Holder::Compactor), vec!["a".to_owned()]);
        assert_eq!(budget.take_evicted(Holder::Archive), vec!["c".to_owned()]);
        let stats = budget.stats();
        assert_eq!((stats.sessions, stats.evictions), (1, 3));
        assert_eq!(stats.held_bytes, 2500 + SESSION_OVERHEAD_BYTES);
        assert_eq!(stats.by_holder, HeldBy { tracker: 0, compactor: 0, archive: 2500 });
        assert!(budget.holds(Holder::Archive, "d") && !budget.holds(Holder::Tracker, "d"));
    }

    #[test]
    fn a_session_larger_than_the_budget_stays_alone() {
        let budget = StateBudget::new(1000);
        budget.charge(Holder::Compactor, "small", 10);
        budget.charge(Holder::Compactor, "huge", 5000);
        assert_eq!(budget.take_evicted(Holder::Compactor), vec!["small".to_owned()]);
        assert_eq!(budget.stats().sessions, 1);
    }

    #[test]
    fn reservations_count_against_the_budget_and_release_forgets() {
        let budget = StateBudget::new(2000);
        budget.reserve(1500);
        budget.charge(Holder::Tracker, "a", 100);
        budget.charge(Holder::Tracker, "b", 100);
        assert_eq!(budget.take_evicted(Holder::Tracker), vec!["a".to_owned()]);
        budget.charge(Holder::Archive, "b", 30);
        assert_eq!(budget.stats().by_holder, HeldBy { tracker: 100, compactor: 0, archive: 30 });
        budget.release(Holder::Tracker, "b");
        assert_eq!(budget.stats().by_holder, HeldBy { tracker: 0, compactor: 0, archive: 30 });
        budget.release(Holder::Archive, "b");
        let stats = budget.stats();
        assert_eq!((stats.held_bytes, stats.reserved_bytes, stats.sessions), (1500, 1500, 0));
    }
}
