//! Physical memory the hypervisor may hand out: the memory map's available regions, page-aligned
//! inwards, minus every range that is already in use (the image, the boot information, the
//! modules, the first MiB). Pure and allocation-free, so it runs before the heap exists and is
//! unit-tested on the host.

use core::fmt;

pub const PAGE_SIZE: u64 = 4096;

/// A half-open physical range `[start, end)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Range {
    pub start: u64,
    pub end: u64,
}

impl Range {
    pub const fn new(start: u64, end: u64) -> Self {
        Self { start, end }
    }
    pub fn len(&self) -> u64 {
        self.end.saturating_sub(self.start)
    }
    pub fn is_empty(&self) -> bool {
        self.end <= self.start
    }
    pub fn overlaps(&self, other: &Range) -> bool {
        self.start < other.end && other.start < self.end
    }
}

impl fmt::Display for Range {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}-{:#x}", self.start, self.end)
    }
}

/// At most this many free ranges are kept; the rest is counted as lost (reported at boot).
pub const MAX_RANGES: usize = 64;

/// The free ranges left after the exclusions, sorted by address, non-overlapping.
#[derive(Clone, Debug)]
pub struct FreeRanges {
    ranges: [Range; MAX_RANGES],
    len: usize,
    /// Bytes of available memory dropped because more than `MAX_RANGES` ranges resulted.
    pub dropped_bytes: u64,
}

impl FreeRanges {
    /// Builds the free ranges from `available` (any order, may overlap) minus `excluded`, keeping
    /// only memory below `limit` (the end of what the hypervisor has mapped).
    pub fn new(
        available: impl IntoIterator<Item = Range>,
        excluded: &[Range],
        limit: u64,
    ) -> FreeRanges {
        let mut out = FreeRanges {
            ranges: [Range::default(); MAX_RANGES],
            len: 0,
            dropped_bytes: 0,
        };
        for r in available {
            let start = align_up(r.start).min(limit);
            let end = align_down(r.end.min(limit));
            if start < end {
                out.subtract_and_insert(Range::new(start, end), excluded);
            }
        }
        out
    }

    fn subtract_and_insert(&mut self, r: Range, excluded: &[Range]) {
        // Find the first exclusion overlapping `r`; split around it and recurse on both sides.
        if let Some(x) = excluded.iter().find(|x| x.overlaps(&r)) {
            let left = Range::new(r.start, align_down(x.start.max(r.start)));
            let right = Range::new(align_up(x.end.min(r.end)), r.end);
            if !left.is_empty() {
                self.subtract_and_insert(left, excluded);
            }
            if !right.is_empty() {
                self.subtract_and_insert(right, excluded);
            }
            return;
        }
        // Merge with what is there already (overlapping or adjacent available regions).
        let mut merged = r;
        let mut i = 0;
        while i < self.len {
            let e = self.ranges[i];
            if e.start <= merged.end && merged.start <= e.end {
                merged = Range::new(merged.start.min(e.start), merged.end.max(e.end));
                self.remove(i);
            } else {
                i += 1;
            }
        }
        if self.len == MAX_RANGES {
            self.dropped_bytes += merged.len();
            return;
        }
        let pos = self.ranges[..self.len]
            .iter()
            .position(|e| e.start > merged.start)
            .unwrap_or(self.len);
        self.ranges.copy_within(pos..self.len, pos + 1);
        self.ranges[pos] = merged;
        self.len += 1;
    }

    fn remove(&mut self, i: usize) {
        self.ranges.copy_within(i + 1..self.len, i);
        self.len -= 1;
    }

    pub fn as_slice(&self) -> &[Range] {
        &self.ranges[..self.len]
    }

    pub fn total_bytes(&self) -> u64 {
        self.as_slice().iter().map(Range::len).sum()
    }

    /// Takes `bytes` (rounded up to whole pages) aligned to `align` (a power of two, at least a
    /// page) from the lowest range that can hold them.
    pub fn take(&mut self, bytes: u64, align: u64) -> Option<u64> {
        let bytes = align_up(bytes.max(1));
        let align = align.max(PAGE_SIZE);
        if !align.is_power_of_two() {
            return None;
        }
        for i in 0..self.len {
            let r = self.ranges[i];
            let start = r.start.checked_add(align - 1)? & !(align - 1);
            let Some(end) = start.checked_add(bytes) else {
                continue;
            };
            if end > r.end {
                continue;
            }
            // Keep the part before the aligned start, if any, and the rest after it.
            let before = Range::new(r.start, start);
            let after = Range::new(end, r.end);
            self.remove(i);
            for part in [before, after] {
                if !part.is_empty() {
                    self.subtract_and_insert(part, &[]);
                }
            }
            return Some(start);
        }
        None
    }
}

pub fn align_up(x: u64) -> u64 {
    x.saturating_add(PAGE_SIZE - 1) & !(PAGE_SIZE - 1)
}

pub fn align_down(x: u64) -> u64 {
    x & !(PAGE_SIZE - 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn bochs_like_map() {
        // 512 MiB machine: low memory, then 1 MiB..512 MiB minus the ACPI tables at the top.
        let available = [Range::new(0, 0x9f000), Range::new(MIB, 512 * MIB - 0x10000)];
        let image = Range::new(2 * MIB, 2 * MIB + 0x5_3000);
        let module = Range::new(0x80_0000, 0x80_1234);
        let free = FreeRanges::new(available, &[Range::new(0, MIB), image, module], 4 << 30);
        assert_eq!(
            free.as_slice(),
            &[
                Range::new(MIB, 2 * MIB),
                Range::new(2 * MIB + 0x5_3000, 0x80_0000),
                Range::new(0x80_2000, 512 * MIB - 0x10000),
            ]
        );
        assert_eq!(free.dropped_bytes, 0);
    }

    #[test]
    fn limit_and_alignment() {
        let free = FreeRanges::new([Range::new(0x1001, 0x10_0fff)], &[], 0x8000);
        assert_eq!(free.as_slice(), &[Range::new(0x2000, 0x8000)]);
    }

    #[test]
    fn take_aligned() {
        let mut free = FreeRanges::new([Range::new(0x1000, 0x100_0000)], &[], u64::MAX);
        assert_eq!(free.take(0x1000, 0x1000), Some(0x1000));
        assert_eq!(free.take(0x10_0000, 0x20_0000), Some(0x20_0000));
        assert_eq!(
            free.as_slice(),
            &[
                Range::new(0x2000, 0x20_0000),
                Range::new(0x30_0000, 0x100_0000)
            ]
        );
        assert_eq!(free.take(0x1_0000_0000, 0x1000), None);
    }

    fn ranges() -> impl Strategy<Value = Vec<Range>> {
        prop::collection::vec((0u64..1 << 24, 0u64..1 << 22), 0..12)
            .prop_map(|v| v.into_iter().map(|(s, l)| Range::new(s, s + l)).collect())
    }

    proptest! {
        /// Free ranges are sorted, disjoint, page-aligned, inside an available region, and
        /// outside every exclusion; every available, non-excluded page is free.
        #[test]
        fn free_ranges_are_exact(avail in ranges(), excl in ranges(), limit in 0u64..1 << 25) {
            let free = FreeRanges::new(avail.iter().copied(), &excl, limit);
            let s = free.as_slice();
            for w in s.windows(2) {
                prop_assert!(w[0].end < w[1].start);
            }
            let page_free = |p: u64| s.iter().any(|r| r.start <= p && p + PAGE_SIZE <= r.end);
            for p in (0..(1u64 << 25) / PAGE_SIZE).map(|i| i * PAGE_SIZE).step_by(7) {
                let page = Range::new(p, p + PAGE_SIZE);
                let expected = p + PAGE_SIZE <= limit
                    && avail.iter().any(|a| a.start <= p && p + PAGE_SIZE <= a.end)
                    && !excl.iter().any(|x| x.overlaps(&page));
                prop_assert_eq!(page_free(p), expected, "page {:#x}", p);
            }
        }

        #[test]
        fn take_never_hands_out_twice(avail in ranges(), sizes in prop::collection::vec(1u64..1 << 20, 1..20)) {
            let mut free = FreeRanges::new(avail.iter().copied(), &[], u64::MAX);
            let before = free.total_bytes();
            let mut taken: Vec<Range> = Vec::new();
            for (i, size) in sizes.iter().enumerate() {
                let align = PAGE_SIZE << (i % 4);
                if let Some(at) = free.take(*size, align) {
                    prop_assert_eq!(at % align, 0);
                    let r = Range::new(at, at + align_up(*size));
                    prop_assert!(taken.iter().all(|t| !t.overlaps(&r)));
                    prop_assert!(free.as_slice().iter().all(|f| !f.overlaps(&r)));
                    taken.push(r);
                }
            }
            let taken_bytes: u64 = taken.iter().map(Range::len).sum();
            prop_assert_eq!(free.total_bytes() + taken_bytes, before);
        }
    }
}
