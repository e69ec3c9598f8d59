//! What the hypervisor knows exactly at the end of a VM or of the run, carried in frames so the
//! analyzer never reads it from console text: per-VM exit statistics in the spirit of
//! `perf kvm stat` (per exit reason the count and the handler cost in TSC ticks from the VM exit
//! to the next VM entry: total, minimum, maximum and a log2 histogram; I/O exits per port), the
//! guest's IA32_LSTAR and the task offsets the VM was profiled with (frame type 5), and each
//! pCPU's whole profiling cost (frame type 6).
//!
//! The hypervisor counts into [`ExitStats`] on every exit (no allocation, a few adds) and prints
//! [`ExitStats::table`] for people; both sides use these same types.

use core::fmt;

/// Basic exit reasons are below this (Intel SDM Vol. 3D Appendix C, "VMX Basic Exit Reasons";
/// the highest defined is 78 on current processors).
pub const EXIT_REASONS: usize = 80;
/// Distinct I/O ports counted one by one; the others are counted together.
pub const EXIT_PORTS: usize = 16;
/// Buckets of the handler-cost histogram (see [`histogram_bucket`]).
pub const HISTOGRAM_BUCKETS: usize = 16;

/// The histogram bucket of a handler cost: bucket 0 holds costs below 64 ticks, bucket `i` in
/// `1..=14` costs in `[2^(5+i), 2^(6+i))` (64-127, 128-255, …), bucket 15 everything from 2^20.
#[must_use]
pub const fn histogram_bucket(ticks: u64) -> usize {
    // The bit length less 6, with bit 5 set so that it is at least 6 (costs below 64 share
    // bucket 0): a nonzero value's length is one BSR, and no subtraction saturates (the
    // hypervisor buckets every exit).
    let bits = (64 - (ticks | 32).leading_zeros()) as usize;
    let b = bits - 6;
    if b > HISTOGRAM_BUCKETS - 1 {
        HISTOGRAM_BUCKETS - 1
    } else {
        b
    }
}

/// The smallest cost bucket `b` holds ([`histogram_bucket`]); the bucket ends where the next
/// begins, the last one never.
#[must_use]
pub const fn histogram_bucket_start(b: usize) -> u64 {
    if b == 0 { 0 } else { 1 << (5 + b) }
}

/// One exit reason's counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReasonStats {
    /// Exits of this reason.
    pub count: u64,
    /// Their handler cost, TSC ticks (saturating).
    pub total: u64,
    /// The cheapest and dearest (0 when `count` is 0).
    pub min: u64,
    /// See `min`.
    pub max: u64,
    /// Exits per cost bucket ([`histogram_bucket`]); each saturates at `u32::MAX`.
    pub histogram: [u32; HISTOGRAM_BUCKETS],
}

impl ReasonStats {
    /// Mean handler cost, ticks (0 without exits).
    #[must_use]
    pub fn mean(&self) -> u64 {
        self.total.checked_div(self.count).unwrap_or(0)
    }

    fn add(&mut self, o: &ReasonStats) {
        if o.count == 0 {
            return;
        }
        self.min = if self.count == 0 {
            o.min
        } else {
            self.min.min(o.min)
        };
        self.max = self.max.max(o.max);
        self.count += o.count;
        self.total = self.total.saturating_add(o.total);
        for (h, n) in self.histogram.iter_mut().zip(o.histogram) {
            *h = h.saturating_add(n);
        }
    }
}

/// A vCPU's or a VM's exit statistics.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExitStats {
    reasons: [ReasonStats; EXIT_REASONS],
    /// Exits whose basic reason is `EXIT_REASONS` or above (counted, never indexed).
    pub other: u64,
    ports: [(u16, u64); EXIT_PORTS],
    ports_used: usize,
    /// I/O exits on ports beyond the first `EXIT_PORTS` distinct ones.
    pub ports_other: u64,
}

impl Default for ExitStats {
    fn default() -> Self {
        Self::new()
    }
}

impl ExitStats {
    /// No exits.
    #[must_use]
    pub const fn new() -> Self {
        const Z: ReasonStats = ReasonStats {
            count: 0,
            total: 0,
            min: 0,
            max: 0,
            histogram: [0; HISTOGRAM_BUCKETS],
        };
        Self {
            reasons: [Z; EXIT_REASONS],
            other: 0,
            ports: [(0, 0); EXIT_PORTS],
            ports_used: 0,
            ports_other: 0,
        }
    }

    /// Records one handled exit of basic reason `reason` that cost `ticks`.
    pub fn record(&mut self, reason: u16, ticks: u64) {
        let Some(s) = self.reasons.get_mut(usize::from(reason)) else {
            self.other += 1;
            return;
        };
        // The usual exit is neither its reason's cheapest nor its dearest: each is a compare and
        // a branch, with no store.
        if s.count == 0 || ticks < s.min {
            s.min = ticks;
        }
        if ticks > s.max {
            s.max = ticks;
        }
        s.count += 1;
        // (2^64 ticks are centuries at any TSC rate: the sum cannot wrap.)
        s.total = s.total.wrapping_add(ticks);
        let h = &mut s.histogram[histogram_bucket(ticks)];
        *h = h.saturating_add(1);
    }

    /// Records one I/O exit on `port`.
    pub fn record_port(&mut self, port: u16) {
        self.add_port(port, 1);
    }

    /// Adds `n` I/O exits on `port` (a decoder rebuilding a table).
    pub fn add_port_count(&mut self, port: u16, n: u64) {
        self.add_port(port, n);
    }

    fn add_port(&mut self, port: u16, n: u64) {
        if let Some(p) = self.ports[..self.ports_used]
            .iter_mut()
            .find(|p| p.0 == port)
        {
            p.1 += n;
        } else if self.ports_used < EXIT_PORTS {
            self.ports[self.ports_used] = (port, n);
            self.ports_used += 1;
        } else {
            self.ports_other += n;
        }
    }

    /// Sets a reason's counts as a whole (a decoder rebuilding a table). `false` (and nothing
    /// changed) for a reason beyond the table.
    pub fn set_reason(&mut self, reason: u16, stats: ReasonStats) -> bool {
        match self.reasons.get_mut(usize::from(reason)) {
            Some(s) => {
                *s = stats;
                true
            }
            None => false,
        }
    }

    /// Adds `other`'s counts to these (a VM's table from its vCPUs' tables).
    pub fn merge(&mut self, other: &ExitStats) {
        for (s, o) in self.reasons.iter_mut().zip(&other.reasons) {
            s.add(o);
        }
        self.other += other.other;
        self.ports_other += other.ports_other;
        for &(port, n) in other.ports() {
            self.add_port(port, n);
        }
    }

    /// One reason's counts (zero beyond the table).
    #[must_use]
    pub fn reason(&self, reason: u16) -> ReasonStats {
        self.reasons
            .get(usize::from(reason))
            .copied()
            .unwrap_or_default()
    }

    /// The reasons that occurred, by reason number.
    pub fn reasons(&self) -> impl Iterator<Item = (u16, &ReasonStats)> + '_ {
        (0u16..).zip(&self.reasons).filter(|(_, s)| s.count > 0)
    }

    /// I/O exits per port, in the order the ports were first seen.
    #[must_use]
    pub fn ports(&self) -> &[(u16, u64)] {
        &self.ports[..self.ports_used]
    }

    /// I/O exits on `port` (0 if it is not among the first `EXIT_PORTS` ports).
    #[must_use]
    pub fn port(&self, port: u16) -> u64 {
        self.ports().iter().find(|p| p.0 == port).map_or(0, |p| p.1)
    }

    /// Every exit, known reason or not.
    #[must_use]
    pub fn total_exits(&self) -> u64 {
        self.reasons.iter().map(|s| s.count).sum::<u64>() + self.other
    }

    /// The table for people (console text), with `name` giving each reason's name.
    #[must_use]
    pub fn table<'a>(&'a self, vm: &'a str, name: fn(u16) -> &'static str) -> Table<'a> {
        Table {
            stats: self,
            vm,
            name,
        }
    }
}

/// [`ExitStats`] as console text, most frequent reason first.
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
        let mut order = [0u16; EXIT_REASONS];
        for (o, r) in order.iter_mut().zip(0u16..) {
            *o = r;
        }
        order.sort_unstable_by_key(|&r| (core::cmp::Reverse(s.reasons[usize::from(r)].count), r));
        for r in order {
            let st = s.reasons[usize::from(r)];
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
        for &(port, n) in s.ports() {
            writeln!(f, "vm {vm}: io port {port:#06x} {n:>10}")?;
        }
        if s.ports_other > 0 {
            writeln!(f, "vm {vm}: io port (others) {:>10}", s.ports_other)?;
        }
        Ok(())
    }
}

/// Where a Linux guest keeps its running task, as given with `task-offsets=`
/// (`current_task:pid:tgid:comm`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct TaskOffsets {
    /// The per-CPU variable `current_task`: its offset from the per-CPU base (GS base).
    pub current_task: u64,
    /// `task_struct.pid` (i32).
    pub pid: u32,
    /// `task_struct.tgid` (i32).
    pub tgid: u32,
    /// `task_struct.comm` (char[16]).
    pub comm: u32,
}

impl TaskOffsets {
    /// Parses `current_task:pid:tgid:comm` (each decimal or 0x-hex).
    #[must_use]
    pub fn parse(s: &str) -> Option<TaskOffsets> {
        let mut it = s.split(':').map(|v| match v.strip_prefix("0x") {
            Some(h) => u64::from_str_radix(h, 16).ok(),
            None => v.parse::<u64>().ok(),
        });
        let mut next = || it.next().flatten();
        let t = TaskOffsets {
            current_task: next()?,
            pid: u32::try_from(next()?).ok()?,
            tgid: u32::try_from(next()?).ok()?,
            comm: u32::try_from(next()?).ok()?,
        };
        next().is_none().then_some(t)
    }
}

/// The most spin sites a VM end frame carries (8 vCPUs, 8 guest RIPs each).
pub const MAX_SPIN_SITES: usize = 64;

/// Where a vCPU's pause-loop exits were: its guest RIP and how many there.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Hash)]
pub struct SpinSite {
    /// The vCPU that spun.
    pub vcpu: u16,
    /// The guest RIP of its PAUSE.
    pub rip: u64,
    /// Its pause-loop exits there: at least 1.
    pub exits: u64,
}

/// A VM's pause-loop exiting (`ple=on|directed`): the controls it ran with and where its vCPUs
/// spun. Each exit ended a spin of at least `window` TSC ticks at CPL 0 (SDM Vol. 3C §26.1.3).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PauseLoop {
    /// A PLE exit yields to a preempted vCPU of the same VM first (`ple=directed`).
    pub directed: bool,
    /// PLE_Gap, TSC ticks: a PAUSE this long after the one before it starts a new loop.
    pub gap: u32,
    /// PLE_Window, TSC ticks: how long a loop spins before it exits.
    pub window: u32,
    sites: [SpinSite; MAX_SPIN_SITES],
    len: usize,
    /// Exits at guest RIPs beyond those kept.
    pub others: u64,
}

impl PauseLoop {
    /// No sites yet.
    #[must_use]
    pub const fn new(directed: bool, gap: u32, window: u32) -> Self {
        PauseLoop {
            directed,
            gap,
            window,
            sites: [SpinSite {
                vcpu: 0,
                rip: 0,
                exits: 0,
            }; MAX_SPIN_SITES],
            len: 0,
            others: 0,
        }
    }

    /// Keeps `site` (one with no exits is left out); one that does not fit is counted in
    /// `others`.
    pub fn add(&mut self, site: SpinSite) {
        if site.exits == 0 {
            return;
        }
        if self.len < MAX_SPIN_SITES {
            self.sites[self.len] = site;
            self.len += 1;
        } else {
            self.others = self.others.saturating_add(site.exits);
        }
    }

    /// The sites kept, in the order added.
    #[must_use]
    pub fn sites(&self) -> &[SpinSite] {
        &self.sites[..self.len]
    }

    /// Every pause-loop exit of the VM.
    #[must_use]
    pub fn exits(&self) -> u64 {
        self.sites()
            .iter()
            .fold(self.others, |n, s| n.saturating_add(s.exits))
    }
}

/// The most vCPUs a VM end frame describes the virtual PMU of (a VM's vCPUs at most).
pub const MAX_VPMU_VCPUS: usize = 8;

/// What one vCPU's virtual PMU counted over the run (`hvprof_hypervisor::vcpu_pmu::VpmuStats`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct VpmuCounts {
    /// The vCPU.
    pub vcpu: u16,
    /// Ticks of the guest's own run its counters counted.
    pub guest_ticks: u64,
    /// Instructions the hypervisor emulated for it, counted as retired.
    pub emulated: u64,
    /// The hypervisor's ticks on its exits, counted in `vpmu=domain`.
    pub hypervisor_ticks: u64,
    /// PMIs delivered to its local APIC.
    pub pmis: u64,
    /// PMIs that waited for the rate limit.
    pub held: u64,
    /// PMIs with no taker (no local APIC, or its entry masked).
    pub undelivered: u64,
    /// Exits the virtual PMU caused or served (its MSRs, RDPMC, a stop for a counter's wrap, a
    /// change of mode): part of what profiling costs.
    pub exits: u64,
    /// The hypervisor's ticks on those exits.
    pub exit_ticks: u64,
}

/// A VM's virtual PMU (`vpmu=cpu|domain`) at its end: the accounting mode and each vCPU's
/// counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VpmuEnd {
    /// `vpmu=domain`: the counters also counted the hypervisor's work on the vCPU's exits.
    pub domain: bool,
    vcpus: [VpmuCounts; MAX_VPMU_VCPUS],
    len: usize,
}

impl VpmuEnd {
    /// No vCPU yet.
    #[must_use]
    pub const fn new(domain: bool) -> Self {
        VpmuEnd {
            domain,
            vcpus: [VpmuCounts {
                vcpu: 0,
                guest_ticks: 0,
                emulated: 0,
                hypervisor_ticks: 0,
                pmis: 0,
                held: 0,
                undelivered: 0,
                exits: 0,
                exit_ticks: 0,
            }; MAX_VPMU_VCPUS],
            len: 0,
        }
    }

    /// Adds a vCPU's counts; false (nothing added) when `MAX_VPMU_VCPUS` are there.
    pub fn add(&mut self, c: VpmuCounts) -> bool {
        let Some(slot) = self.vcpus.get_mut(self.len) else {
            return false;
        };
        *slot = c;
        self.len += 1;
        true
    }

    /// The vCPUs' counts, in the order added.
    #[must_use]
    pub fn vcpus(&self) -> &[VpmuCounts] {
        &self.vcpus[..self.len]
    }
}

/// What the hypervisor knows about a VM when it stops (frame type 5).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct VmEnd {
    /// The VM (`Header::vms` id).
    pub vm: u16,
    /// Its vCPU 0's IA32_LSTAR when it stopped: a Linux guest's system-call entry, which moves
    /// with its kernel (the KASLR slide). 0 if never written.
    pub lstar: u64,
    /// The task offsets it was profiled with, if any.
    pub task_offsets: Option<TaskOffsets>,
    /// Its vCPUs' exit statistics together.
    pub exits: ExitStats,
    /// Its pause-loop exiting, when on.
    pub pause_loop: Option<PauseLoop>,
    /// Its virtual PMU, when it has one.
    pub vpmu: Option<VpmuEnd>,
    /// Whether its Linux guest isolates its page tables (KPTI), as the hypervisor found at a
    /// user-mode sample: a user-mode CR3 is then the user PGD of a pair, bit 12 above the
    /// kernel PGD the process's maps were read through. `None`: not found out (no Linux guest,
    /// no user-mode sample, or a frame from before this field).
    pub page_table_isolation: Option<bool>,
}

/// One pCPU's whole profiling cost over the run, in TSC ticks, in disjoint parts (frame type 6).
/// Samples cannot see most of it: a sampling exit begins with its sample and ends a period
/// before the next one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct PcpuCost {
    /// The pCPU.
    pub pcpu: u16,
    /// Ticks from the start of sampling on this pCPU to its end.
    pub span_ticks: u64,
    /// Samples taken.
    pub samples: u64,
    /// VM exits that exist only to take a sample, and their ticks from VM exit to VM entry.
    pub sampling_exits: u64,
    /// See `sampling_exits`.
    pub sampling_exit_ticks: u64,
    /// LAPIC timer interrupts (samples of the hypervisor and of idle time), and their ticks.
    pub timer_interrupts: u64,
    /// See `timer_interrupts`.
    pub timer_ticks: u64,
    /// The sample path (and task reads) of samples taken elsewhere, on other exits.
    pub other_sample_ticks: u64,
    /// Draining, encoding and sending the log during the run.
    pub export_ticks: u64,
    /// Reads of a Linux guest's running task (inside the ticks above), and their ticks.
    pub task_reads: u64,
    /// See `task_reads`.
    pub task_read_ticks: u64,
}

impl PcpuCost {
    /// The whole cost, ticks (the parts are disjoint; task reads are inside them).
    #[must_use]
    pub const fn whole(&self) -> u64 {
        self.other_sample_ticks + self.sampling_exit_ticks + self.timer_ticks + self.export_ticks
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
        assert_eq!(c.histogram[histogram_bucket(300)], 2); // 300 and 500 share 256..511
        assert_eq!(c.histogram[histogram_bucket(100)], 1);
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
        assert_eq!(
            s.reasons().map(|(r, _)| r).collect::<Vec<_>>(),
            vec![10, 30]
        );
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

    #[test]
    fn histogram_buckets_are_powers_of_two_from_64() {
        assert_eq!(histogram_bucket(0), 0);
        assert_eq!(histogram_bucket(63), 0);
        assert_eq!(histogram_bucket(64), 1);
        assert_eq!(histogram_bucket(127), 1);
        assert_eq!(histogram_bucket(128), 2);
        assert_eq!(histogram_bucket((1 << 20) - 1), 14);
        assert_eq!(histogram_bucket(1 << 20), 15);
        assert_eq!(histogram_bucket(u64::MAX), 15);
        for b in 0..HISTOGRAM_BUCKETS {
            let start = histogram_bucket_start(b);
            assert_eq!(histogram_bucket(start), b);
            if b > 0 {
                assert_eq!(histogram_bucket(start - 1), b - 1);
            }
        }
    }

    #[test]
    fn task_offsets_parse() {
        assert_eq!(
            TaskOffsets::parse("0x10:1:2:3"),
            Some(TaskOffsets {
                current_task: 16,
                pid: 1,
                tgid: 2,
                comm: 3
            })
        );
        assert_eq!(TaskOffsets::parse("1:2"), None);
        assert_eq!(TaskOffsets::parse("1:2:3:4:5"), None);
        assert_eq!(TaskOffsets::parse("1:2:3:0x100000000"), None);
    }
}
