//! Lists that are each in time order merged into one: the replay's samples of several pCPUs,
//! and the scheduling events, which come per pCPU in time order already.

use std::collections::BTreeMap;

use hvprof_samplelog::Event;

/// `lists` (each in order of `key`) merged in that order, on a tie the item of the list that
/// comes first; `None` without lists. They are merged two by two, then the results, with no
/// branch on the data per item. The lists emptied, and those merging made, go to `pool`, whose
/// lists it uses first.
pub(crate) fn merge_all<T: Copy>(
    mut level: Vec<Vec<T>>,
    pool: &mut Vec<Vec<T>>,
    key: impl Fn(&T) -> u64 + Copy,
) -> Option<Vec<T>> {
    while level.len() > 1 {
        let mut next = Vec::with_capacity(level.len().div_ceil(2));
        let mut pairs = level.into_iter();
        while let Some(a) = pairs.next() {
            match pairs.next() {
                Some(b) => {
                    let mut out = pool.pop().unwrap_or_default();
                    merge_two(&a, &b, &mut out, key);
                    pool.extend([a, b]);
                    next.push(out);
                }
                None => next.push(a),
            }
        }
        level = next;
    }
    level.pop()
}

/// `a` and `b` (each in order of `key`) merged into `out` in that order, `a`'s item first on
/// a tie.
pub(crate) fn merge_two<T: Copy>(a: &[T], b: &[T], out: &mut Vec<T>, key: impl Fn(&T) -> u64) {
    out.clear();
    out.reserve(a.len() + b.len());
    let (mut i, mut j) = (0, 0);
    while i < a.len() && j < b.len() {
        let (x, y) = (a[i], b[j]);
        let left = key(&x) <= key(&y);
        out.push(if left { x } else { y });
        i += usize::from(left);
        j += usize::from(!left);
    }
    out.extend_from_slice(&a[i..]);
    out.extend_from_slice(&b[j..]);
}

/// Scheduling events with their pCPU put in (TSC, pCPU) order, as a stable sort on that key
/// puts them: each pCPU's taken in the order given (sorted by TSC, stably, only when they are
/// not in TSC order already, as a damaged capture's may not be), then merged, the lower pCPU
/// first on a tie. A capture's events come per pCPU in time order, so this is a merge of a few
/// lists, not a sort of them all (5-6 ms on 380 k events, against 12-14 ms).
pub(crate) fn sort_events(events: &mut Vec<(u16, Event)>) {
    let mut per_pcpu: BTreeMap<u16, Vec<(u16, Event)>> = BTreeMap::new();
    for &(p, e) in events.iter() {
        per_pcpu.entry(p).or_default().push((p, e));
    }
    let mut lists: Vec<Vec<(u16, Event)>> = per_pcpu.into_values().collect();
    for list in &mut lists {
        if !list.is_sorted_by_key(|(_, e)| e.tsc) {
            list.sort_by_key(|(_, e)| e.tsc);
        }
    }
    let mut pool = vec![std::mem::take(events)];
    if let Some(merged) = merge_all(lists, &mut pool, |(_, e)| e.tsc) {
        *events = merged;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hvprof_samplelog::{EventKind, OutReason};
    use proptest::prelude::*;

    proptest! {
        /// Any number of lists in TSC order merged are their samples sorted by (TSC, list),
        /// whatever the pool's lists held.
        #[test]
        fn lists_merge_in_tsc_then_list_order(
            lists in prop::collection::vec(prop::collection::vec(0u64..50, 0..30), 0..40),
        ) {
            let lists: Vec<Vec<(u64, u32)>> = lists
                .into_iter()
                .enumerate()
                .map(|(i, mut l)| {
                    l.sort_unstable();
                    l.into_iter().map(|t| (t, i as u32)).collect()
                })
                .collect();
            let mut want: Vec<(u64, u32)> = lists.iter().flatten().copied().collect();
            want.sort_unstable();
            let mut pool = vec![vec![(7, 7)]];
            let got = merge_all(lists.clone(), &mut pool, |&(t, _)| t).unwrap_or_default();
            prop_assert_eq!(got, want);
        }

        /// Events end in the order a stable sort by (TSC, pCPU) gives, whether each pCPU's
        /// come in TSC order or not (their order among equal TSCs kept).
        #[test]
        fn events_sort_as_a_stable_sort_does(
            raw in prop::collection::vec((0u16..6, 0u64..40, any::<bool>(), 0u16..4), 0..300),
            in_order in any::<bool>(),
        ) {
            let mut events: Vec<(u16, Event)> = raw
                .iter()
                .map(|&(pcpu, tsc, out, vcpu)| {
                    (pcpu, Event {
                        tsc,
                        kind: if out { EventKind::VcpuOut } else { EventKind::VcpuIn },
                        vm: 1,
                        vcpu,
                        reason: OutReason::Preempted,
                    })
                })
                .collect();
            if in_order {
                // As a capture's: each pCPU's in time order, the pCPUs taking turns (a block
                // each).
                events.sort_by_key(|(_, e)| e.tsc);
                events.sort_by_key(|&(p, e)| (e.tsc / 8, p));
            }
            let mut want = events.clone();
            want.sort_by_key(|&(p, e)| (e.tsc, p));
            sort_events(&mut events);
            prop_assert_eq!(events, want);
        }
    }
}
