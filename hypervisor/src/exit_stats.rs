//! Per-VM exit statistics in the spirit of `perf kvm stat`: for each exit reason, the count and
//! the handler cost in TSC ticks (from the VM exit to the next VM entry): total, minimum,
//! maximum, mean. I/O exits are also counted per port.

use core::fmt;

/// Basic exit reasons are below this (Intel SDM Vol. 3D Appendix C).
pub const REASONS: usize = 80;
pub const PORTS: usize = 16;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReasonStats {
    pub count: u64,
    pub total: u64,
    pub min: u64,
    pub max: u64,
}

impl ReasonStats {
    pub fn mean(&self) -> u64 {
        self.total.checked_div(self.count).unwrap_or(0)
    }
}

#[derive(Clone, Debug)]
pub struct ExitStats {
    reasons: [ReasonStats; REASONS],
    /// Exits whose basic reason is out of range (counted, never indexed).
    pub other: u64,
    ports: [(u16, u64); PORTS],
    ports_used: usize,
    /// I/O exits on ports beyond the first `PORTS` distinct ones.
    pub ports_other: u64,
}

impl Default for ExitStats {
    fn default() -> Self {
        Self {
            reasons: [ReasonStats::default(); REASONS],
            other: 0,
            ports: [(0, 0); PORTS],
            ports_used: 0,
            ports_other: 0,
        }
    }
}

impl ExitStats {
    /// Records one handled exit that cost `ticks`.
    pub fn record(&mut self, reason: u16, ticks: u64) {
        let Some(s) = self.reasons.get_mut(reason as usize) else {
            self.other += 1;
            return;
        };
        if s.count == 0 || ticks < s.min {
            s.min = ticks;
        }
        s.max = s.max.max(ticks);
        s.count += 1;
        s.total = s.total.saturating_add(ticks);
    }

    pub fn record_port(&mut self, port: u16) {
        if let Some(p) = self.ports[..self.ports_used]
            .iter_mut()
            .find(|p| p.0 == port)
        {
            p.1 += 1;
        } else if self.ports_used < PORTS {
            self.ports[self.ports_used] = (port, 1);
            self.ports_used += 1;
        } else {
            self.ports_other += 1;
        }
    }

    /// Adds `other`'s counts to these (a VM's table from its vCPUs' tables).
    pub fn merge(&mut self, other: &ExitStats) {
        for (s, o) in self.reasons.iter_mut().zip(&other.reasons) {
            if o.count == 0 {
                continue;
            }
            s.min = if s.count == 0 {
                o.min
            } else {
                s.min.min(o.min)
            };
            s.max = s.max.max(o.max);
            s.count += o.count;
            s.total = s.total.saturating_add(o.total);
        }
        self.other += other.other;
        self.ports_other += other.ports_other;
        for &(port, n) in &other.ports[..other.ports_used] {
            if let Some(p) = self.ports[..self.ports_used]
                .iter_mut()
                .find(|p| p.0 == port)
            {
                p.1 += n;
            } else if self.ports_used < PORTS {
                self.ports[self.ports_used] = (port, n);
                self.ports_used += 1;
            } else {
                self.ports_other += n;
            }
        }
    }

    pub fn reason(&self, reason: u16) -> ReasonStats {
        self.reasons
            .get(reason as usize)
            .copied()
            .unwrap_or_default()
    }

    pub fn port(&self, port: u16) -> u64 {
        self.ports[..self.ports_used]
            .iter()
            .find(|p| p.0 == port)
            .map_or(0, |p| p.1)
    }

    pub fn total_exits(&self) -> u64 {
        self.reasons.iter().map(|s| s.count).sum::<u64>() + self.other
    }

    /// The table, with `name` giving each reason's name.
    pub fn table<'a>(&'a self, vm: &'a str, name: fn(u16) -> &'static str) -> Table<'a> {
        Table {
            stats: self,
            vm,
            name,
        }
    }
}

pub struct Table<'a> {
    stats: &'a ExitStats,
    vm: &'a str,
    name: fn(u16) -> &'static str,
}

impl fmt::Display for Table<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = self.stats;
        let vm = self.vm;
        writeln!(
            f,
            "vm {vm}: exits: {} in all; handler cost in TSC ticks, VM exit to VM entry",
            s.total_exits()
        )?;
        writeln!(
            f,
            "vm {vm}: exit {:<22} {:>10} {:>14} {:>9} {:>9} {:>9}",
            "reason", "count", "total", "min", "max", "mean"
        )?;
        let mut order: [u16; REASONS] = core::array::from_fn(|i| i as u16);
        order.sort_by_key(|&r| core::cmp::Reverse(s.reasons[r as usize].count));
        for r in order {
            let st = s.reasons[r as usize];
            if st.count == 0 {
                continue;
            }
            writeln!(
                f,
                "vm {vm}: exit {:<22} {:>10} {:>14} {:>9} {:>9} {:>9}",
                (self.name)(r),
                st.count,
                st.total,
                st.min,
                st.max,
                st.mean()
            )?;
        }
        if s.other > 0 {
            writeln!(
                f,
                "vm {vm}: exit {:<22} {:>10}",
                "(unknown reason)", s.other
            )?;
        }
        for &(port, n) in &s.ports[..s.ports_used] {
            writeln!(f, "vm {vm}: io port {port:#06x} {n:>10}")?;
        }
        if s.ports_other > 0 {
            writeln!(f, "vm {vm}: io port (others) {:>10}", s.ports_other)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(r: u16) -> &'static str {
        match r {
            10 => "CPUID",
            30 => "IO_INSTRUCTION",
            _ => "?",
        }
    }

    #[test]
    fn merge_adds_vcpu_tables() {
        let mut a = ExitStats::default();
        let mut b = ExitStats::default();
        a.record(10, 300);
        a.record_port(0x3f8);
        b.record(10, 100);
        b.record(10, 500);
        b.record(30, 7);
        b.record_port(0x3f8);
        b.record_port(0xf4);
        let mut vm = ExitStats::default();
        vm.merge(&a);
        vm.merge(&b);
        let c = vm.reason(10);
        assert_eq!((c.count, c.total, c.min, c.max), (3, 900, 100, 500));
        assert_eq!(vm.reason(30).count, 1);
        assert_eq!((vm.port(0x3f8), vm.port(0xf4)), (2, 1));
        assert_eq!(vm.total_exits(), 4);
        // Merging an empty table changes nothing (its zero minimum is not taken).
        vm.merge(&ExitStats::default());
        assert_eq!(vm.reason(10).min, 100);
    }

    #[test]
    fn counts_and_costs() {
        let mut s = ExitStats::default();
        for t in [300, 100, 200] {
            s.record(10, t);
        }
        s.record(30, 50);
        s.record(200, 1);
        let c = s.reason(10);
        assert_eq!(
            (c.count, c.total, c.min, c.max, c.mean()),
            (3, 600, 100, 300, 200)
        );
        assert_eq!(s.total_exits(), 5);
        assert_eq!(s.other, 1);
        let text = s.table("hello", name).to_string();
        let cpuid = text.lines().position(|l| l.contains("CPUID")).unwrap();
        let io = text
            .lines()
            .position(|l| l.contains("IO_INSTRUCTION"))
            .unwrap();
        assert!(cpuid < io, "sorted by count:\n{text}");
        assert!(text.contains("vm hello: exits: 5 in all"));
    }

    #[test]
    fn ports() {
        let mut s = ExitStats::default();
        for p in 0..20u16 {
            s.record_port(p);
            s.record_port(p);
        }
        assert_eq!(s.port(3), 2);
        assert_eq!(s.port(19), 0);
        assert_eq!(s.ports_other, 8);
    }
}
