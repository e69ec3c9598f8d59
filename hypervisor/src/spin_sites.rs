//! Where a vCPU spun: the guest RIP of each of its pause-loop exits (`ple=`), counted per RIP
//! for the first `SITES` RIPs seen, the rest counted together. A spin loop has one PAUSE, so a
//! guest has few such RIPs (a spinlock's, an IPI wait's); the table stays small and fixed, and a
//! guest that spins at many places cannot grow it.

/// RIPs counted one by one.
pub const SITES: usize = 8;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpinSites {
    sites: [(u64, u64); SITES],
    used: usize,
    /// Exits at RIPs beyond the first `SITES`.
    others: u64,
}

impl SpinSites {
    pub const fn new() -> Self {
        SpinSites {
            sites: [(0, 0); SITES],
            used: 0,
            others: 0,
        }
    }

    /// Counts one pause-loop exit at `rip`.
    pub fn record(&mut self, rip: u64) {
        if let Some(site) = self.sites[..self.used].iter_mut().find(|s| s.0 == rip) {
            site.1 += 1;
        } else if self.used < SITES {
            self.sites[self.used] = (rip, 1);
            self.used += 1;
        } else {
            self.others += 1;
        }
    }

    /// Every exit counted.
    pub fn total(&self) -> u64 {
        self.sites[..self.used].iter().map(|s| s.1).sum::<u64>() + self.others
    }

    /// (RIP, exits) per site, the most exits first (ties by RIP).
    pub fn by_count(&self) -> impl Iterator<Item = (u64, u64)> {
        let mut sites = self.sites;
        let used = self.used;
        sites[..used].sort_unstable_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        (0..used).map(move |i| sites[i])
    }

    /// Exits at RIPs the table had no room for.
    pub fn others(&self) -> u64 {
        self.others
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_per_rip_most_first_and_the_rest_together() {
        let mut s = SpinSites::new();
        assert_eq!(s.total(), 0);
        assert_eq!(s.by_count().count(), 0);
        for _ in 0..3 {
            s.record(0x10);
        }
        s.record(0x20);
        for _ in 0..5 {
            s.record(0x30);
        }
        assert_eq!(
            s.by_count().collect::<Vec<_>>(),
            vec![(0x30, 5), (0x10, 3), (0x20, 1)]
        );
        // Eight sites fill the table; the ninth RIP and after go to `others`.
        for rip in 0x40..0x45 {
            s.record(rip);
        }
        assert_eq!(s.by_count().count(), SITES);
        s.record(0x99);
        s.record(0x99);
        s.record(0x10);
        assert_eq!((s.others(), s.total()), (2, 3 + 1 + 1 + 5 + 5 + 2));
        assert_eq!(s.by_count().next(), Some((0x30, 5)));
        assert_eq!(s.by_count().nth(1), Some((0x10, 4)));
    }
}
