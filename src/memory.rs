//! Where pare keeps what it knows of each session, under one memory budget in bytes
//! (`memory.max_state_bytes`).
//!
//! A session is one entry of one least-recently-used list, holding a part for each holder: the
//! session tracker's keys, the compactor's frozen prefix, counts and arrival times, and the archive
//! writer's cursor (per message of the last bodies, what the next body is a delta against: a blob id
//! and a digest, never the bytes). Each holder makes, finds and replaces its own part
//! ([`StateBudget::part`]); the fixed-size caches of token counts and message keys reserve their
//! full capacity up front ([`StateBudget::reserve`]).
//!
//! Each holder says, after changing its part, how many bytes that now is ([`StateBudget::charge`]);
//! the session becomes the most recently used. While the total is over the budget the least
//! recently used *whole* sessions are evicted: every part goes at once. A holder that indexes its
//! sessions by something else (the tracker, by key) asks to be told ([`StateBudget::notify`]) and
//! takes the parts evicted since it last ran ([`StateBudget::take_evicted`]). The store never calls
//! into a holder or locks a part, so holders may charge while holding their own locks.
//!
//! An evicted session that comes back is rebuilt from the archive, as after a restart (the tracker
//! finds it by its stored answer keys, the compactor resumes its frozen prefix from the stored
//! plan, the writer reloads its cursor), so forwarding is the same as if it had stayed; without an
//! archive it starts afresh.

use std::any::Any;
use std::sync::{Arc, Mutex};

use lru::LruCache;

/// Default budget: 256 MiB.
pub const DEFAULT_MAX_STATE_BYTES: u64 = 256 * 1024 * 1024;

/// Bytes of bookkeeping counted for a session (its id, its entry), on top of what the holders
/// charge.
pub const SESSION_OVERHEAD_BYTES: u64 = 256;

/// Who keeps a part of a session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Holder {
    /// [`crate::session::SessionTracker`]: ext keys, pending requests.
    Tracker = 0,
    /// [`crate::budget::compactor::SessionCompactor`]: the frozen prefix, counts, arrival times.
    Compactor = 1,
    /// The archive writer's cursor: per message of the session's last raw and forwarded lists, its
    /// blob id, separator and digest.
    Archive = 2,
    /// Mode `observe` ([`crate::observe`]): per message of the session's last raw and projected
    /// requests, its hash and tokens.
    Observer = 3,
}

const N_HOLDERS: usize = 4;

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
    pub observer: u64,
}

/// A holder's part of a session, of the type the holder chose.
type Part = Arc<dyn Any + Send + Sync>;

/// One session: each holder's part and the bytes it charged.
#[derive(Default)]
struct Entry {
    parts: [Option<Part>; N_HOLDERS],
    bytes: [u64; N_HOLDERS],
}

struct Store {
    /// Every session, least recently used first.
    sessions: LruCache<String, Entry>,
    session_bytes: u64,
    /// Of `session_bytes`, each holder's part (the per-session overhead aside).
    holder_bytes: [u64; N_HOLDERS],
    reserved: u64,
    /// Holders told of evictions, and the parts of theirs evicted since they last took them.
    evicted: [Option<Vec<(String, Part)>>; N_HOLDERS],
    n_evictions: u64,
}

impl Store {
    /// The entry of `session`, the most recently used from now on, inserted empty when new.
    fn touch(&mut self, session: &str) -> &mut Entry {
        if !self.sessions.contains(session) {
            self.session_bytes += SESSION_OVERHEAD_BYTES;
            self.sessions.push(session.to_owned(), Entry::default());
        }
        self.sessions.get_mut(session).expect("just inserted")
    }

    fn set_bytes(&mut self, session: &str, holder: Holder, bytes: u64) {
        let h = holder as usize;
        if let Some(entry) = self.sessions.peek_mut(session) {
            self.session_bytes = self.session_bytes - entry.bytes[h] + bytes;
            self.holder_bytes[h] = self.holder_bytes[h] - entry.bytes[h] + bytes;
            entry.bytes[h] = bytes;
        }
    }

    /// Evict least recently used sessions while the total is over `max_bytes` (never the last one).
    fn evict_over(&mut self, max_bytes: u64) {
        while self.session_bytes + self.reserved > max_bytes && self.sessions.len() > 1 {
            let Some((session, entry)) = self.sessions.pop_lru() else { break };
            self.session_bytes -= entry.bytes.iter().sum::<u64>() + SESSION_OVERHEAD_BYTES;
            self.n_evictions += 1;
            for (h, (part, bytes)) in entry.parts.into_iter().zip(entry.bytes).enumerate() {
                self.holder_bytes[h] -= bytes;
                if let (Some(part), Some(told)) = (part, self.evicted[h].as_mut()) {
                    told.push((session.clone(), part));
                }
            }
        }
    }

    /// Remove `session` when no holder keeps a part of it any more.
    fn drop_if_empty(&mut self, session: &str) {
        if self.sessions.peek(session).is_some_and(|entry| entry.parts.iter().all(Option::is_none)) {
            let entry = self.sessions.pop(session).expect("just peeked");
            self.session_bytes -= entry.bytes.iter().sum::<u64>() + SESSION_OVERHEAD_BYTES;
            for (h, bytes) in entry.bytes.iter().enumerate() {
                self.holder_bytes[h] -= bytes;
            }
        }
    }
}

/// Every session's state under one byte budget (see the module docs).
pub struct StateBudget {
    max_bytes: u64,
    store: Mutex<Store>,
}

impl std::fmt::Debug for StateBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StateBudget").field("stats", &self.stats()).finish()
    }
}

/// `part` as the holder's type; a part of another type (never made: each holder makes its own) is
/// none.
fn downcast<T: Any + Send + Sync>(part: &Part) -> Option<Arc<T>> {
    Arc::clone(part).downcast::<T>().ok()
}

impl StateBudget {
    pub fn new(max_bytes: u64) -> StateBudget {
        StateBudget {
            max_bytes,
            store: Mutex::new(Store {
                sessions: LruCache::unbounded(),
                session_bytes: 0,
                holder_bytes: [0; N_HOLDERS],
                reserved: 0,
                evicted: Default::default(),
                n_evictions: 0,
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Store> {
        // The store is consistent after every statement that can panic: keep using it.
        self.store.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Reserve `bytes` for a fixed-size cache for as long as pare runs (its full capacity).
    pub fn reserve(&self, bytes: u64) {
        self.lock().reserved += bytes;
    }

    /// Keep the parts of `holder` that evictions drop, for [`StateBudget::take_evicted`].
    pub fn notify(&self, holder: Holder) {
        self.lock().evicted[holder as usize].get_or_insert_with(Vec::new);
    }

    /// `holder`'s part of `session`, made by `make` when it has none; the session becomes the most
    /// recently used. A new part is charged nothing until [`StateBudget::charge`].
    pub fn part<T: Any + Send + Sync>(&self, holder: Holder, session: &str, make: impl FnOnce() -> T) -> Arc<T> {
        let mut store = self.lock();
        let entry = store.touch(session);
        if let Some(part) = entry.parts[holder as usize].as_ref().and_then(downcast::<T>) {
            return part;
        }
        let part = Arc::new(make());
        entry.parts[holder as usize] = Some(Arc::clone(&part) as Part);
        let max_bytes = self.max_bytes;
        store.evict_over(max_bytes);
        part
    }

    /// `holder`'s part of `session`, when it has one; the session's place in the list is unchanged.
    pub fn peek_part<T: Any + Send + Sync>(&self, holder: Holder, session: &str) -> Option<Arc<T>> {
        self.lock().sessions.peek(session)?.parts[holder as usize].as_ref().and_then(downcast::<T>)
    }

    /// Make `part` `holder`'s part of `session` (in place of any other), weighing `bytes`; the
    /// session becomes the most recently used.
    pub fn put_part<T: Any + Send + Sync>(&self, holder: Holder, session: &str, part: T, bytes: u64) -> Arc<T> {
        let part = Arc::new(part);
        let mut store = self.lock();
        store.touch(session).parts[holder as usize] = Some(Arc::clone(&part) as Part);
        store.set_bytes(session, holder, bytes);
        let max_bytes = self.max_bytes;
        store.evict_over(max_bytes);
        part
    }

    /// `holder`'s part of `session` now weighs `bytes`, and the session becomes the most recently
    /// used. Evicts the least recently used other sessions while the total is over the budget. A
    /// part the store no longer holds (evicted while its holder worked on it) is charged nothing.
    pub fn charge(&self, holder: Holder, session: &str, bytes: u64) {
        let mut store = self.lock();
        match store.sessions.get(session) {
            Some(entry) if entry.parts[holder as usize].is_some() => {}
            _ => return,
        }
        store.set_bytes(session, holder, bytes);
        let max_bytes = self.max_bytes;
        store.evict_over(max_bytes);
    }

    /// `holder` keeps nothing more for `session`: its part goes, and the session with its last part.
    pub fn release(&self, holder: Holder, session: &str) {
        let mut store = self.lock();
        store.set_bytes(session, holder, 0);
        if let Some(entry) = store.sessions.peek_mut(session) {
            entry.parts[holder as usize] = None;
        }
        store.drop_if_empty(session);
    }

    /// `holder` keeps nothing more for any session.
    pub fn release_all(&self, holder: Holder) {
        let mut store = self.lock();
        let held: Vec<String> = store
            .sessions
            .iter()
            .filter(|(_, entry)| entry.parts[holder as usize].is_some())
            .map(|(session, _)| session.clone())
            .collect();
        for session in held {
            store.set_bytes(&session, holder, 0);
            if let Some(entry) = store.sessions.peek_mut(&session) {
                entry.parts[holder as usize] = None;
            }
            store.drop_if_empty(&session);
        }
    }

    /// The parts of `holder` evicted since it last asked (with [`StateBudget::notify`]; none
    /// without), with their sessions.
    pub fn take_evicted<T: Any + Send + Sync>(&self, holder: Holder) -> Vec<(String, Arc<T>)> {
        let mut store = self.lock();
        let Some(evicted) = store.evicted[holder as usize].as_mut().filter(|e| !e.is_empty()) else {
            return Vec::new();
        };
        std::mem::take(evicted)
            .into_iter()
            .filter_map(|(session, part)| Some((session, downcast::<T>(&part)?)))
            .collect()
    }

    /// Whether `holder` keeps a part of `session`.
    pub fn holds(&self, holder: Holder, session: &str) -> bool {
        self.lock().sessions.peek(session).is_some_and(|entry| entry.parts[holder as usize].is_some())
    }

    /// Sessions `holder` keeps a part of.
    pub fn count(&self, holder: Holder) -> usize {
        self.lock().sessions.iter().filter(|(_, entry)| entry.parts[holder as usize].is_some()).count()
    }

    pub fn stats(&self) -> BudgetStats {
        let store = self.lock();
        BudgetStats {
            held_bytes: store.session_bytes + store.reserved,
            max_bytes: self.max_bytes,
            reserved_bytes: store.reserved,
            sessions: store.sessions.len() as u64,
            evictions: store.n_evictions,
            by_holder: HeldBy {
                tracker: store.holder_bytes[Holder::Tracker as usize],
                compactor: store.holder_bytes[Holder::Compactor as usize],
                archive: store.holder_bytes[Holder::Archive as usize],
                observer: store.holder_bytes[Holder::Observer as usize],
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

    /// A part for the tests: its charge is its own.
    fn hold(budget: &StateBudget, holder: Holder, session: &str, bytes: u64) -> Arc<u64> {
        let part = budget.part(holder, session, || bytes);
        budget.charge(holder, session, bytes);
        part
    }

    fn sessions(evicted: Vec<(String, Arc<u64>)>) -> Vec<String> {
        evicted.into_iter().map(|(session, _)| session).collect()
    }

    #[test]
    fn least_recently_used_whole_sessions_are_evicted_with_every_part() {
        let budget = StateBudget::new(3 * 1000 + 3 * SESSION_OVERHEAD_BYTES);
        budget.notify(Holder::Tracker);
        hold(&budget, Holder::Tracker, "a", 400);
        hold(&budget, Holder::Compactor, "a", 600);
        hold(&budget, Holder::Tracker, "b", 1000);
        hold(&budget, Holder::Archive, "c", 1000);
        assert_eq!(budget.stats().evictions, 0);
        // "a" is used again: "b" is now the least recently used.
        budget.charge(Holder::Compactor, "a", 600);
        hold(&budget, Holder::Archive, "d", 10);
        assert_eq!(sessions(budget.take_evicted(Holder::Tracker)), ["b"]);
        assert!(budget.take_evicted::<u64>(Holder::Tracker).is_empty(), "told once");
        assert!(budget.take_evicted::<u64>(Holder::Compactor).is_empty(), "not told without asking");
        // Growing "d" evicts "a" (both parts at once) and then "c".
        budget.charge(Holder::Archive, "d", 2500);
        let evicted = budget.take_evicted::<u64>(Holder::Tracker);
        assert_eq!(evicted.iter().map(|(s, part)| (s.as_str(), **part)).collect::<Vec<_>>(), [("a", 400)]);
        assert!(budget.peek_part::<u64>(Holder::Compactor, "a").is_none());
        assert!(budget.peek_part::<u64>(Holder::Archive, "c").is_none());
        let stats = budget.stats();
        assert_eq!((stats.sessions, stats.evictions), (1, 3));
        assert_eq!(stats.held_bytes, 2500 + SESSION_OVERHEAD_BYTES);
        assert_eq!(stats.by_holder, HeldBy { tracker: 0, compactor: 0, archive: 2500, observer: 0 });
        assert!(budget.holds(Holder::Archive, "d") && !budget.holds(Holder::Tracker, "d"));
    }

    #[test]
    fn a_part_is_found_again_and_a_charge_for_an_evicted_part_counts_nothing() {
        let budget = StateBudget::new(1000 + 2 * SESSION_OVERHEAD_BYTES);
        let made = hold(&budget, Holder::Compactor, "a", 10);
        let found = budget.part(Holder::Compactor, "a", || 99u64);
        assert!(Arc::ptr_eq(&made, &found), "the same part");
        hold(&budget, Holder::Compactor, "b", 2000);
        assert!(!budget.holds(Holder::Compactor, "a"));
        // The holder still worked on "a": its charge must not bring back bytes without a part.
        budget.charge(Holder::Compactor, "a", 10);
        let stats = budget.stats();
        assert_eq!((stats.sessions, stats.by_holder.compactor), (1, 2000));
        assert_eq!(budget.count(Holder::Compactor), 1);
    }

    #[test]
    fn a_session_larger_than_the_budget_stays_alone() {
        let budget = StateBudget::new(1000);
        hold(&budget, Holder::Compactor, "small", 10);
        hold(&budget, Holder::Compactor, "huge", 5000);
        assert!(!budget.holds(Holder::Compactor, "small"));
        assert_eq!(budget.stats().sessions, 1);
    }

    /// One step of a holder's use of the store.
    #[derive(Debug, Clone)]
    enum Op {
        Part(usize, usize),
        Charge(usize, usize, u64),
        Put(usize, usize, u64),
        Release(usize, usize),
        ReleaseAll(usize),
        TakeEvicted,
    }

    fn op() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        let (holder, session, bytes) = (0..N_HOLDERS, 0..6usize, 0..3000u64);
        prop_oneof![
            (holder.clone(), session.clone()).prop_map(|(h, s)| Op::Part(h, s)),
            (holder.clone(), session.clone(), bytes.clone()).prop_map(|(h, s, b)| Op::Charge(h, s, b)),
            (holder.clone(), session.clone(), bytes).prop_map(|(h, s, b)| Op::Put(h, s, b)),
            (holder.clone(), session).prop_map(|(h, s)| Op::Release(h, s)),
            holder.prop_map(Op::ReleaseAll),
            Just(Op::TakeEvicted),
        ]
    }

    const HOLDERS: [Holder; N_HOLDERS] = [Holder::Tracker, Holder::Compactor, Holder::Archive, Holder::Observer];

    proptest::proptest! {
        /// Whatever the holders do, the totals are the sum of what the entries hold, an entry
        /// holds bytes only for parts it has, and the budget holds unless one session alone is over.
        #[test]
        fn the_store_accounts_for_exactly_the_parts_it_holds(ops in proptest::collection::vec(op(), 1..80)) {
            let budget = StateBudget::new(4000);
            budget.notify(Holder::Tracker);
            for op in ops {
                match op {
                    Op::Part(h, s) => drop(budget.part(HOLDERS[h], &s.to_string(), || 0u64)),
                    Op::Charge(h, s, b) => budget.charge(HOLDERS[h], &s.to_string(), b),
                    Op::Put(h, s, b) => drop(budget.put_part(HOLDERS[h], &s.to_string(), b, b)),
                    Op::Release(h, s) => budget.release(HOLDERS[h], &s.to_string()),
                    Op::ReleaseAll(h) => budget.release_all(HOLDERS[h]),
                    Op::TakeEvicted => drop(budget.take_evicted::<u64>(Holder::Tracker)),
                }
                let store = budget.lock();
                let mut holder_bytes = [0u64; N_HOLDERS];
                for (_, entry) in store.sessions.iter() {
                    proptest::prop_assert!(entry.parts.iter().any(Option::is_some) || entry.bytes == [0; N_HOLDERS]);
                    for ((part, bytes), sum) in entry.parts.iter().zip(entry.bytes).zip(&mut holder_bytes) {
                        proptest::prop_assert!(part.is_some() || bytes == 0, "bytes without a part");
                        *sum += bytes;
                    }
                }
                proptest::prop_assert_eq!(store.holder_bytes, holder_bytes);
                let overhead = store.sessions.len() as u64 * SESSION_OVERHEAD_BYTES;
                proptest::prop_assert_eq!(store.session_bytes, holder_bytes.iter().sum::<u64>() + overhead);
                proptest::prop_assert!(store.session_bytes <= 4000 || store.sessions.len() == 1);
            }
        }
    }

    #[test]
    fn reservations_count_against_the_budget_and_release_forgets() {
        let budget = StateBudget::new(2000);
        budget.reserve(1500);
        hold(&budget, Holder::Tracker, "a", 100);
        hold(&budget, Holder::Tracker, "b", 100);
        assert!(!budget.holds(Holder::Tracker, "a"));
        hold(&budget, Holder::Archive, "b", 30);
        assert_eq!(budget.stats().by_holder, HeldBy { tracker: 100, compactor: 0, archive: 30, observer: 0 });
        budget.release(Holder::Tracker, "b");
        assert_eq!(budget.stats().by_holder, HeldBy { tracker: 0, compactor: 0, archive: 30, observer: 0 });
        budget.release_all(Holder::Archive);
        let stats = budget.stats();
        assert_eq!((stats.held_bytes, stats.reserved_bytes, stats.sessions), (1500, 1500, 0));
    }
}
