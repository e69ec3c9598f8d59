//! The sample path's core, shared by guest and hypervisor samples: the deadline clock that says
//! a sample is due, the record put into the pCPU's ring as its only producer, and the path's
//! own cost, measured from TSC in to TSC out. The processor is reached through [`Processor`]
//! (its TSC and interrupt flag) and the VMCS through [`FastRead`], so the binary gives them the
//! real CPU (`bin/hvprof/profiler/sampler.rs`) and the tests below a scripted one.

use super::costs::{Costs, PathCost};
use super::deadline::DeadlineClock;
use super::guest_sample::{self, FastRead, Running};
use super::ring::Ring;
use super::slots::{self, Slot, Stamped};
use core::sync::atomic::{AtomicBool, Ordering};
use hvprof_samplelog::{Record, Sample};

/// What the sample path and its walks use of the processor besides the VMCS.
pub trait Processor {
    /// The time stamp counter (RDTSC).
    fn tsc(&self) -> u64;
    /// Runs `f` with maskable interrupts off, then restores RFLAGS.IF as it was.
    fn without_interrupts<R>(&self, f: impl FnOnce() -> R) -> R;
    /// Whether maskable interrupts are on (RFLAGS.IF).
    fn interrupts_enabled(&self) -> bool;
    /// Model-specific register `msr` (RDMSR), `None` where reading it faults. The guest MSRs
    /// the hypervisor loads with a vCPU (IA32_LSTAR among them) hold the guest's values while
    /// that vCPU is loaded.
    fn read_msr(&self, msr: u32) -> Option<u64>;
}

/// Whether a push's caller may run with interrupts on (the producer then keeps the timer's
/// interrupt out for the push), or runs with them off already (the guest sample path, right
/// after a VM exit).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Irqs {
    MayBeOn,
    Off,
}

/// A guest sample just taken: its path's ticks, the TSC at its end, and the guest state it read
/// that the task read after it needs (the same VMCS fields, not read twice).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GuestSampled {
    /// The sample's time (the exit's TSC).
    pub tsc: u64,
    /// TSC ticks from the sample path's start to its end, bookkeeping included.
    pub cost: u64,
    /// The TSC at the sample path's end.
    pub end: u64,
    pub rip: u64,
    pub cr3: u64,
    pub cpl: u8,
}

impl GuestSampled {
    /// The sample at `tsc` of `rip`, `cr3` at `cpl`, whose path ran from `t0` to `end`.
    #[inline(always)]
    pub fn new((tsc, rip, cr3, cpl): (u64, u64, u64, u8), t0: u64, end: u64) -> Self {
        GuestSampled {
            tsc,
            rip,
            cr3,
            cost: end - t0,
            end,
            cpl,
        }
    }
}

/// One pCPU's sample path: its deadline clock, its own cost, and the flag that makes it the
/// ring's only producer while a push is under way.
pub struct SamplePath {
    /// The sampling deadlines (the one place that decides a deadline sample is due).
    pub clock: DeadlineClock,
    /// The path's own cost: samples taken, total, smallest and largest (TSC ticks).
    pub cost: PathCost,
    /// A push into the ring is under way (see [`SamplePath::offer`]).
    pushing: AtomicBool,
}

impl Default for SamplePath {
    fn default() -> Self {
        Self::new()
    }
}

impl SamplePath {
    #[must_use]
    pub const fn new() -> Self {
        SamplePath {
            clock: DeadlineClock::new(),
            cost: PathCost::new(),
            pushing: AtomicBool::new(false),
        }
    }

    /// Puts a record into `ring`. The ring has one producer, but on one pCPU that producer runs
    /// in three contexts: the run loop and scheduler, the timer interrupt and the PMU's NMI. The
    /// interrupt is kept out while the others push; an NMI that lands inside a push finds the
    /// ring busy and its record is counted as a drop rather than corrupting the one in flight.
    /// A sample's chain frames follow it (`offer_with_frames`, kept out of the common path).
    #[inline(always)]
    pub fn offer<const N: usize>(
        &self,
        cpu: &impl Processor,
        ring: &Ring<Slot, N>,
        record: Record,
        frames: &[u64],
        irqs: Irqs,
    ) {
        if !frames.is_empty() {
            return self.offer_with_frames(cpu, ring, record, frames, irqs);
        }
        // Built straight into the ring's slot (`push_with`), not copied through temporaries.
        self.exclusive(cpu, ring, irqs, |drops| {
            ring.push_with(1, |_| Slot::Record(Stamped { record, drops }))
        });
    }

    #[inline(never)]
    fn offer_with_frames<const N: usize>(
        &self,
        cpu: &impl Processor,
        ring: &Ring<Slot, N>,
        record: Record,
        frames: &[u64],
        irqs: Irqs,
    ) {
        self.exclusive(cpu, ring, irqs, |drops| {
            let stamped = Stamped { record, drops };
            ring.push_with(slots::slots_for(frames.len()), |i| {
                slots::slot(stamped, frames, i)
            })
        });
    }

    /// Runs `push` (given the ring's drop count) as the ring's only producer on this pCPU: with
    /// the timer's interrupt kept out (already, for `Irqs::Off`), and a push that lands inside
    /// another (an NMI's) counted as a drop.
    #[inline(always)]
    fn exclusive<const N: usize>(
        &self,
        cpu: &impl Processor,
        ring: &Ring<Slot, N>,
        irqs: Irqs,
        push: impl FnOnce(u64) -> bool,
    ) {
        let produce = || {
            if self.pushing.swap(true, Ordering::Acquire) {
                ring.count_drop();
                return;
            }
            push(ring.dropped());
            self.pushing.store(false, Ordering::Release);
        };
        match irqs {
            Irqs::Off => {
                debug_assert!(
                    !cpu.interrupts_enabled(),
                    "a push said Irqs::Off with IF set"
                );
                produce()
            }
            Irqs::MayBeOn => cpu.without_interrupts(produce),
        }
    }

    /// Records sample `s` taken since `t0` (with its chains' `frames`): its cost is the ticks
    /// from `t0` to just before the push (what the sample carries and the path's cost counts),
    /// and a path longer than half a period moves the next deadline on (`DeadlineClock::stretch`,
    /// counted in `costs.stretched`). Returns the TSC at the end, bookkeeping included.
    /// Inlined: the sample is then built in registers and its cost read before any of it is
    /// stored (the bench's sample path and sampling exit figures).
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    pub fn push<const N: usize>(
        &self,
        cpu: &impl Processor,
        ring: &Ring<Slot, N>,
        costs: &Costs,
        mut s: Sample,
        frames: &[u64],
        t0: u64,
        irqs: Irqs,
    ) -> u64 {
        let cost = cpu.tsc() - t0;
        s.cost = cost.min(u32::MAX as u64) as u32;
        if self.clock.stretch(t0, cost) {
            costs.stretched.fetch_add(1, Ordering::Relaxed);
        }
        self.offer(cpu, ring, Record::Sample(s), frames, irqs);
        self.cost.record(cost);
        cpu.tsc()
    }

    /// The guest sample without a chain, from the VMCS of the vCPU that exited at `now` (with
    /// interrupts off: right after a VM exit), as `running` runs it.
    #[inline(always)]
    pub fn guest<const N: usize>(
        &self,
        cpu: &impl Processor,
        vmcs: &impl FastRead,
        ring: &Ring<Slot, N>,
        costs: &Costs,
        running: Running,
        now: u64,
    ) -> GuestSampled {
        let t0 = cpu.tsc();
        let (s, cpl, _) = guest_sample::guest_sample(vmcs, running, now);
        let read = (now, s.guest_rip, s.guest_cr3, cpl);
        let end = self.push(cpu, ring, costs, s, &[], t0, Irqs::Off);
        GuestSampled::new(read, t0, end)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::cell::Cell;
    use hvprof_samplelog::{Chain, SampleKind};
    use hvprof_vmx::fake::FakeVmcs;
    use hvprof_vmx::vmcs::{Guest32, Guest64, GuestNatural, VmcsExt};

    /// A processor whose TSC moves on by `step` at each read, with interrupts off (as after a
    /// VM exit) unless `irqs_on`; it counts the times it kept them out and the slots that a
    /// ring it watches gained meanwhile.
    struct Scripted<'r> {
        tsc: Cell<u64>,
        step: u64,
        irqs_on: bool,
        masked: Cell<u32>,
        masking: Cell<bool>,
        watch: Option<&'r Ring<Slot, 8>>,
        pushed_masked: Cell<usize>,
    }

    impl Scripted<'_> {
        fn at(tsc: u64, step: u64) -> Self {
            Scripted {
                tsc: Cell::new(tsc),
                step,
                irqs_on: false,
                masked: Cell::new(0),
                masking: Cell::new(false),
                watch: None,
                pushed_masked: Cell::new(0),
            }
        }
    }

    impl Processor for Scripted<'_> {
        fn tsc(&self) -> u64 {
            let t = self.tsc.get() + self.step;
            self.tsc.set(t);
            t
        }
        fn without_interrupts<R>(&self, f: impl FnOnce() -> R) -> R {
            self.masked.set(self.masked.get() + 1);
            let before = self.watch.map_or(0, Ring::len);
            let was = self.masking.replace(true);
            let r = f();
            self.masking.set(was);
            let after = self.watch.map_or(0, Ring::len);
            self.pushed_masked
                .set(self.pushed_masked.get() + after - before);
            r
        }
        fn interrupts_enabled(&self) -> bool {
            self.irqs_on && !self.masking.get()
        }
        fn read_msr(&self, _: u32) -> Option<u64> {
            None
        }
    }

    fn sample(tsc: u64) -> Sample {
        Sample {
            tsc,
            kind: SampleKind::Hypervisor,
            vm: 1,
            vcpu: 0,
            vpid: 3,
            guest_rip: 0,
            guest_cr3: 0,
            guest_mode: 0,
            exit_reason: 48,
            host_rip: 0xffff_8000_0010_0000,
            cost: 0,
            host_chain: Chain::NOT_WALKED,
            guest_chain: Chain::NOT_WALKED,
        }
    }

    fn records<const N: usize>(ring: &Ring<Slot, N>) -> Vec<Slot> {
        core::iter::from_fn(|| ring.pop()).collect()
    }

    fn only_sample(slot: &Slot) -> (Sample, u64) {
        match slot {
            Slot::Record(Stamped {
                record: Record::Sample(s),
                drops,
            }) => (*s, *drops),
            other => panic!("not a sample: {other:?}"),
        }
    }

    #[test]
    fn a_push_carries_its_cost_counts_it_and_returns_the_end() {
        let path = SamplePath::new();
        path.clock.begin(10_000, 1_000, true);
        let (ring, costs) = (Ring::<Slot, 8>::new(), Costs::new(1, 1));
        let cpu = Scripted::at(1_000, 40);
        let end = path.push(&cpu, &ring, &costs, sample(1_000), &[], 1_000, Irqs::Off);
        // Two TSC reads: the cost's (1040) and the end's (1080).
        assert_eq!(end, 1_080);
        let slots = records(&ring);
        assert_eq!(slots.len(), 1);
        let (s, drops) = only_sample(&slots[0]);
        assert_eq!((s.cost, s.tsc, drops), (40, 1_000, 0));
        assert_eq!(path.cost.summary(), (1, 40, 40, 40));
        assert_eq!(costs.stretched.load(Ordering::Relaxed), 0);
        // Interrupts were off already: not masked again.
        assert_eq!(cpu.masked.get(), 0);
    }

    #[test]
    fn a_cost_beyond_u32_saturates_in_the_record_but_not_in_the_tally() {
        let path = SamplePath::new();
        let (ring, costs) = (Ring::<Slot, 8>::new(), Costs::new(1, 1));
        let cpu = Scripted::at(0, 1 << 33);
        path.push(&cpu, &ring, &costs, sample(0), &[], 0, Irqs::Off);
        let (s, _) = only_sample(&records(&ring)[0]);
        assert_eq!(s.cost, u32::MAX);
        assert_eq!(path.cost.summary().1, 1 << 33);
    }

    #[test]
    fn a_path_longer_than_half_a_period_moves_the_next_deadline() {
        let path = SamplePath::new();
        path.clock.begin(1_000, 0, true);
        assert!(path.clock.take_due(1_000));
        assert_eq!(path.clock.next_tick(), 2_000);
        let (ring, costs) = (Ring::<Slot, 8>::new(), Costs::new(1, 1));
        // 700 ticks from t0 = 1000: half a period after 1700.
        let cpu = Scripted::at(1_000, 700);
        path.push(&cpu, &ring, &costs, sample(1_000), &[], 1_000, Irqs::Off);
        assert_eq!(path.clock.next_tick(), 2_200);
        assert_eq!(costs.stretched.load(Ordering::Relaxed), 1);
        // Half a period exactly leaves the deadline alone (the one `take_due` set: a period
        // after the last).
        let cpu = Scripted::at(3_000, 500);
        assert!(path.clock.take_due(3_000));
        assert_eq!(path.clock.next_tick(), 3_200);
        path.push(&cpu, &ring, &costs, sample(3_000), &[], 3_000, Irqs::Off);
        assert_eq!(path.clock.next_tick(), 3_200);
        assert_eq!(costs.stretched.load(Ordering::Relaxed), 1);
    }

    /// A push from code that may run with interrupts on (the scheduler, the idle loop) puts
    /// its record into the ring with them kept out.
    #[test]
    fn a_push_that_may_run_with_interrupts_on_keeps_them_out() {
        let path = SamplePath::new();
        let (ring, costs) = (Ring::<Slot, 8>::new(), Costs::new(1, 1));
        let mut cpu = Scripted::at(0, 1);
        cpu.irqs_on = true;
        cpu.watch = Some(&ring);
        path.push(&cpu, &ring, &costs, sample(0), &[], 0, Irqs::MayBeOn);
        assert_eq!(cpu.masked.get(), 1);
        assert_eq!(
            cpu.pushed_masked.get(),
            1,
            "the record went in while masked"
        );
        assert_eq!(records(&ring).len(), 1);
    }

    /// `Irqs::Off` is a promise (a VM exit cleared RFLAGS.IF): checked in debug builds.
    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "Irqs::Off with IF set")]
    fn a_push_that_says_interrupts_are_off_while_they_are_on_is_caught() {
        let path = SamplePath::new();
        let (ring, costs) = (Ring::<Slot, 8>::new(), Costs::new(1, 1));
        let mut cpu = Scripted::at(0, 1);
        cpu.irqs_on = true;
        path.push(&cpu, &ring, &costs, sample(0), &[], 0, Irqs::Off);
    }

    #[test]
    fn frames_follow_their_record_in_one_push() {
        let path = SamplePath::new();
        let (ring, costs) = (Ring::<Slot, 8>::new(), Costs::new(1, 1));
        let cpu = Scripted::at(0, 1);
        let frames: Vec<u64> = (1..=9).collect();
        let mut s = sample(0);
        s.host_chain = Chain::new(9, hvprof_samplelog::ChainEnd::Complete);
        path.push(&cpu, &ring, &costs, s, &frames, 0, Irqs::Off);
        let slots = records(&ring);
        assert_eq!(slots.len(), slots::slots_for(9));
        assert_eq!(slots::frame_slots(&slots[0]), 2);
        assert_eq!(slots[1], Slot::Frames([1, 2, 3, 4, 5, 6, 7]));
        assert_eq!(slots[2], Slot::Frames([8, 9, 0, 0, 0, 0, 0]));
    }

    /// An NMI's push that lands inside another push is a drop, and the next record carries the
    /// drop count, so the decoder places the loss.
    #[test]
    fn a_push_inside_a_push_is_counted_as_a_drop() {
        let path = SamplePath::new();
        let ring = Ring::<Slot, 8>::new();
        let cpu = Scripted::at(0, 1);
        let event = |t| Record::Sample(sample(t));
        path.exclusive(&cpu, &ring, Irqs::Off, |drops| {
            path.offer(&cpu, &ring, event(1), &[], Irqs::Off);
            ring.push_with(1, |_| {
                Slot::Record(Stamped {
                    record: event(2),
                    drops,
                })
            })
        });
        assert_eq!(ring.dropped(), 1);
        path.offer(&cpu, &ring, event(3), &[], Irqs::Off);
        let stamps: Vec<(u64, u64)> = records(&ring)
            .iter()
            .map(|r| {
                let (s, d) = only_sample(r);
                (s.tsc, d)
            })
            .collect();
        assert_eq!(stamps, [(2, 0), (3, 1)]);
    }

    #[test]
    fn a_full_ring_counts_the_drop_and_the_cost_still_counts() {
        let path = SamplePath::new();
        let (ring, costs) = (Ring::<Slot, 2>::new(), Costs::new(1, 1));
        let cpu = Scripted::at(0, 5);
        for t in 0..3 {
            path.push(
                &cpu,
                &ring,
                &costs,
                sample(t),
                &[],
                cpu.tsc.get(),
                Irqs::Off,
            );
        }
        assert_eq!(ring.dropped(), 1);
        assert_eq!(path.cost.summary(), (3, 5, 5, 5));
        assert_eq!(records(&ring).len(), 2);
    }

    #[test]
    fn a_guest_sample_is_read_from_the_vmcs_and_pushed() {
        let path = SamplePath::new();
        let (ring, costs) = (Ring::<Slot, 8>::new(), Costs::new(1, 1));
        let mut v = FakeVmcs::new();
        v.write_natural(GuestNatural::Rip, 0x40_1000).unwrap();
        v.write_natural(GuestNatural::Cr3, 0x7000).unwrap();
        v.write_natural(GuestNatural::Cr0, 1 | 1 << 31).unwrap();
        v.write64(Guest64::Ia32Efer, 1 << 10 | 1 << 8).unwrap();
        // 64-bit code at CPL 3 (SDM Vol. 3C Table 25-2: type, S, DPL, P, L).
        v.write32(
            Guest32::CsAccessRights,
            0xb | 1 << 4 | 3 << 5 | 1 << 7 | 1 << 13,
        )
        .unwrap();
        v.write32(Guest32::SsAccessRights, 0x3 | 1 << 4 | 3 << 5 | 1 << 7)
            .unwrap();
        let cpu = Scripted::at(5_000, 30);
        let g = path.guest(&cpu, &v, &ring, &costs, (2, 1, 9, 52), 4_990);
        assert_eq!(
            g,
            GuestSampled {
                tsc: 4_990,
                cost: 60,
                end: 5_090,
                rip: 0x40_1000,
                cr3: 0x7000,
                cpl: 3,
            }
        );
        let (s, _) = only_sample(&records(&ring)[0]);
        assert_eq!(s.kind, SampleKind::Guest);
        assert_eq!((s.vm, s.vcpu, s.vpid, s.exit_reason), (2, 1, 9, 52));
        assert_eq!((s.guest_rip, s.guest_cr3, s.cost), (0x40_1000, 0x7000, 30));
        assert_eq!(
            s.guest_mode,
            hvprof_samplelog::guest_mode(3, hvprof_samplelog::MODE_LONG)
        );
    }
}
