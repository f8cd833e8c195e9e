//! What elision needs to weigh a run without reading it again: a summary of what an elision marker
//! says of any span of messages that two adjacent spans combine into ([`MarkerSummary::then`]), a
//! union of runs that keeps each run's summary, and a Fenwick tree for sums over ranges. With them
//! [`super::salience`] weighs each elision step in time logarithmic in the conversation and linear
//! in the marker's lists, each bounded (the ids by [`PRICED_IDS`]), where re-reading the run would
//! make a long conversation's fit quadratic.

use rustc_hash::FxHashMap;

/// What an elision marker says of a span: how many messages it stands for, per tool how many
/// results, assistant notes, the first distinct files (at most [`MAX_FILES`]) and the most recent
/// distinct names (at most the fit's cap). Texts are ids into a [`Texts`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MarkerSummary {
    pub n: usize,
    pub notes: usize,
    /// (tool id, results), by id; a tool an earlier marker listed with no result is kept.
    pub tools: Vec<(u32, usize)>,
    pub files: Vec<u32>,
    pub names: Vec<u32>,
    /// The id-list entries of the outputs ([`super::markers::id_entry`]), most recent first: all of
    /// them up to [`PRICED_IDS`], else the first `PRICED_IDS + 1` distinct.
    pub ids: Vec<u32>,
}

/// The most id-list entries a summary holds all of. A marker of more than a few outputs names one
/// id, that of their list; a step weighs a run's marker with the id of the list of its first
/// `PRICED_IDS + 1` distinct entries when it has more, which reads as many tokens as its own id
/// but costs no more than that list to make. The marker pare writes names the run's whole list.
/// Without the bound a step costs as much as its run's outputs, and a conversation of many short
/// outputs elided into one run takes time quadratic in them.
pub const PRICED_IDS: usize = 128;

/// The files an elision marker lists at most.
pub const MAX_FILES: usize = 8;

impl MarkerSummary {
    /// The summary of this span followed by `later`: counts add up, files are the first distinct
    /// of this span's then the later's, names the most recent distinct of the later span's then
    /// this one's. Exact because each side keeps as many of its own as the whole may list: the
    /// first `cap` distinct items of a sequence are among the first `cap` distinct items of its
    /// parts.
    pub fn then(&self, later: &MarkerSummary, cap: usize, seen: &mut Seen) -> MarkerSummary {
        let mut tools = Vec::with_capacity(self.tools.len() + later.tools.len());
        let (mut a, mut b) = (self.tools.iter().peekable(), later.tools.iter().peekable());
        loop {
            let next = match (a.peek(), b.peek()) {
                (Some(&&(x, n)), Some(&&(y, m))) if x == y => {
                    a.next();
                    b.next();
                    (x, n + m)
                }
                (Some(&&x), Some(&&y)) if x.0 < y.0 => *a.next().expect("peeked"),
                (_, Some(_)) => *b.next().expect("peeked"),
                (Some(_), None) => *a.next().expect("peeked"),
                (None, None) => break,
            };
            tools.push(next);
        }
        let mut files = self.files.clone();
        for &f in &later.files {
            if files.len() >= MAX_FILES {
                break;
            }
            if !files.contains(&f) {
                files.push(f);
            }
        }
        seen.clear();
        let mut names = Vec::with_capacity(cap.min(later.names.len() + self.names.len()));
        for &name in later.names.iter().chain(&self.names) {
            if names.len() >= cap {
                break;
            }
            if seen.insert(name) {
                names.push(name);
            }
        }
        seen.clear();
        let mut ids = Vec::with_capacity((later.ids.len() + self.ids.len()).min(PRICED_IDS + 1));
        for &id in later.ids.iter().chain(&self.ids) {
            if ids.len() > PRICED_IDS {
                break;
            }
            if seen.insert(id) {
                ids.push(id);
            }
        }
        MarkerSummary { n: self.n + later.n, notes: self.notes + later.notes, tools, files, names, ids }
    }
}

/// A set of text ids, cleared in constant time (a generation stamp per id).
#[derive(Debug, Default)]
pub struct Seen {
    stamp: Vec<u32>,
    generation: u32,
}

impl Seen {
    pub fn clear(&mut self) {
        self.generation = self.generation.wrapping_add(1);
        if self.generation == 0 {
            self.stamp.fill(0);
            self.generation = 1;
        }
    }

    /// Whether `id` was not in the set (it is now).
    pub fn insert(&mut self, id: u32) -> bool {
        let at = id as usize;
        if at >= self.stamp.len() {
            self.stamp.resize(at + 1, 0);
        }
        let new = self.stamp[at] != self.generation;
        self.stamp[at] = self.generation;
        new
    }
}

/// The texts summaries refer to, each given one id.
#[derive(Debug, Default)]
pub struct Texts<'t> {
    ids: FxHashMap<&'t str, u32>,
    texts: Vec<&'t str>,
}

impl<'t> Texts<'t> {
    pub fn id(&mut self, text: &'t str) -> u32 {
        *self.ids.entry(text).or_insert_with(|| {
            self.texts.push(text);
            (self.texts.len() - 1) as u32
        })
    }

    pub fn text(&self, id: u32) -> &'t str {
        self.texts[id as usize]
    }
}

/// Sums over ranges of a list of counts that change one by one.
#[derive(Debug, Clone)]
pub struct Fenwick {
    tree: Vec<u64>,
}

impl Fenwick {
    pub fn new(n: usize) -> Fenwick {
        Fenwick { tree: vec![0; n + 1] }
    }

    /// Add `value` at `idx` (a count only ever goes down by what was added at that index).
    pub fn add(&mut self, idx: usize, value: u64) {
        let mut i = idx + 1;
        while i < self.tree.len() {
            self.tree[i] = self.tree[i].wrapping_add(value);
            i += i & i.wrapping_neg();
        }
    }

    pub fn sub(&mut self, idx: usize, value: u64) {
        self.add(idx, value.wrapping_neg());
    }

    /// The sum of `0..end`.
    fn prefix(&self, end: usize) -> u64 {
        let mut i = end;
        let mut sum = 0u64;
        while i > 0 {
            sum = sum.wrapping_add(self.tree[i]);
            i -= i & i.wrapping_neg();
        }
        sum
    }

    /// The sum of `lo..=hi`.
    pub fn range(&self, lo: usize, hi: usize) -> u64 {
        self.prefix(hi + 1).wrapping_sub(self.prefix(lo))
    }
}

/// Runs of consecutive members among `n` slots, where two neighbours join when `joins[i]` (slot `i`
/// with slot `i + 1`): a union-find that keeps each run's first and last slot and its summary.
#[derive(Debug)]
pub struct Runs {
    parent: Vec<u32>,
    member: Vec<bool>,
    first: Vec<u32>,
    last: Vec<u32>,
    summary: Vec<Option<MarkerSummary>>,
}

impl Runs {
    pub fn new(n: usize) -> Runs {
        Runs {
            parent: (0..n as u32).collect(),
            member: vec![false; n],
            first: (0..n as u32).collect(),
            last: (0..n as u32).collect(),
            summary: vec![None; n],
        }
    }

    fn root(&mut self, mut x: usize) -> usize {
        while self.parent[x] as usize != x {
            let grand = self.parent[self.parent[x] as usize];
            self.parent[x] = grand;
            x = grand as usize;
        }
        x
    }

    /// The run of member `x`: its first and last slot and its summary.
    fn run(&mut self, x: usize) -> (usize, usize, &MarkerSummary) {
        let r = self.root(x);
        (self.first[r] as usize, self.last[r] as usize, self.summary[r].as_ref().expect("a run has a summary"))
    }

    /// The run slot `u` would be in once a member (it is not one yet), and that run's summary,
    /// given `u`'s own.
    pub fn would_join(
        &mut self,
        u: usize,
        joins: &[bool],
        own: &MarkerSummary,
        cap: usize,
        seen: &mut Seen,
    ) -> (usize, usize, MarkerSummary) {
        let (mut first, mut last) = (u, u);
        let mut summary = own.clone();
        if u > 0 && joins[u - 1] && self.member[u - 1] {
            let (lo, _, before) = self.run(u - 1);
            first = lo;
            summary = before.then(&summary, cap, seen);
        }
        if u + 1 < self.member.len() && joins[u] && self.member[u + 1] {
            let (_, hi, after) = self.run(u + 1);
            last = hi;
            summary = summary.then(after, cap, seen);
        }
        (first, last, summary)
    }

    /// Make `u` a member, joining its neighbours' runs; `summary` is that of the joined run
    /// ([`Runs::would_join`]).
    pub fn join(&mut self, u: usize, joins: &[bool], summary: MarkerSummary) {
        self.member[u] = true;
        let (mut first, mut last) = (u, u);
        for neighbour in
            [u.checked_sub(1).filter(|&v| joins[v]), Some(u + 1).filter(|&v| v < self.member.len() && joins[u])]
                .into_iter()
                .flatten()
        {
            if !self.member[neighbour] {
                continue;
            }
            let r = self.root(neighbour);
            first = first.min(self.first[r] as usize);
            last = last.max(self.last[r] as usize);
            self.summary[r] = None;
            self.parent[r] = u as u32;
        }
        self.parent[u] = u as u32;
        self.first[u] = first as u32;
        self.last[u] = last as u32;
        self.summary[u] = Some(summary);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fenwick_sums_ranges() {
        let values = [3u64, 0, 7, 1, 9, 2];
        let mut f = Fenwick::new(values.len());
        for (i, v) in values.iter().enumerate() {
            f.add(i, *v);
        }
        for lo in 0..values.len() {
            for hi in lo..values.len() {
                assert_eq!(f.range(lo, hi), values[lo..=hi].iter().sum::<u64>());
            }
        }
        f.sub(2, 7);
        assert_eq!(f.range(0, 5), 15);
    }

    proptest::proptest! {
        /// A summary made by joining the parts of a sequence at any points is that of the whole:
        /// counts, first distinct files, most recent distinct names, the most recent distinct ids
        /// (all of them up to `PRICED_IDS`, else the first `PRICED_IDS + 1`).
        #[test]
        fn summaries_join_at_any_point(
            items in proptest::collection::vec((0u32..6, proptest::collection::vec(0u32..12, 0..4), proptest::collection::vec(0u32..12, 0..4), proptest::collection::vec(0u32..300, 0..40)), 1..12),
            cap in 1usize..6,
            cuts in proptest::collection::vec(0usize..12, 0..4),
        ) {
            let one = |(tool, files, names, ids): &(u32, Vec<u32>, Vec<u32>, Vec<u32>), seen: &mut Seen| {
                let mut s = MarkerSummary { n: 1, notes: usize::from(*tool == 0), tools: vec![(*tool, 1)], ..Default::default() };
                for &f in files { if s.files.len() < MAX_FILES && !s.files.contains(&f) { s.files.push(f); } }
                seen.clear();
                for &n in names { if s.names.len() < cap && seen.insert(n) { s.names.push(n); } }
                for &id in ids { if !s.ids.contains(&id) { s.ids.push(id); } }
                s
            };
            let mut seen = Seen::default();
            // The whole, read in one pass as the marker reads it.
            let mut whole = MarkerSummary::default();
            let mut tools = std::collections::BTreeMap::new();
            for (tool, files, _, _) in &items {
                whole.n += 1;
                whole.notes += usize::from(*tool == 0);
                *tools.entry(*tool).or_insert(0) += 1;
                for &f in files { if whole.files.len() < MAX_FILES && !whole.files.contains(&f) { whole.files.push(f); } }
            }
            whole.tools = tools.into_iter().collect();
            for (_, _, names, ids) in items.iter().rev() {
                for &n in names { if whole.names.len() < cap && !whole.names.contains(&n) { whole.names.push(n); } }
                for &id in ids { if whole.ids.len() <= PRICED_IDS && !whole.ids.contains(&id) { whole.ids.push(id); } }
            }
            // The same, joined from parts cut anywhere, left to right and as a balanced tree.
            let mut cuts: Vec<usize> = cuts.into_iter().filter(|&c| c > 0 && c < items.len()).collect();
            cuts.sort_unstable();
            cuts.dedup();
            let bounds: Vec<usize> = std::iter::once(0).chain(cuts).chain(std::iter::once(items.len())).collect();
            let parts: Vec<MarkerSummary> = bounds.windows(2).map(|w| {
                let mut s = one(&items[w[0]], &mut seen);
                for item in &items[w[0] + 1..w[1]] { let next = one(item, &mut seen); s = s.then(&next, cap, &mut seen); }
                s
            }).collect();
            let mut joined = parts[0].clone();
            for part in &parts[1..] { joined = joined.then(part, cap, &mut seen); }
            proptest::prop_assert_eq!(&joined, &whole);
            let mut right = parts.last().unwrap().clone();
            for part in parts.iter().rev().skip(1) { right = part.then(&right, cap, &mut seen); }
            proptest::prop_assert_eq!(&right, &whole);
        }
    }

    #[test]
    fn runs_join_neighbours_that_join() {
        let joins = [true, false, true, true];
        let mut runs = Runs::new(5);
        let mut seen = Seen::default();
        let one = |n| MarkerSummary { n, ..Default::default() };
        for u in [0, 3, 1, 4, 2] {
            let (first, last, summary) = runs.would_join(u, &joins, &one(1), 8, &mut seen);
            let expected = match u {
                0 | 3 => (u, u, 1),
                1 => (0, 1, 2),
                4 => (3, 4, 2),
                _ => (2, 4, 3),
            };
            assert_eq!((first, last, summary.n), expected, "slot {u}");
            runs.join(u, &joins, summary);
        }
        assert_eq!(runs.run(4).0, 2);
        assert_eq!(runs.run(0).1, 1);
    }
}
