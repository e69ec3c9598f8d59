//! A vCPU's virtual PMU as the run loop drives it (`vpmu=cpu|domain`, docs/PROFILER.md, "A
//! guest's own PMU"): the guest-facing model (`hvprof_pmu::virtual_pmu`: CPUID leaf 0AH, the
//! MSRs, overflow into IA32_PERF_GLOBAL_STATUS) fed by the *emulated* backend, which derives the
//! three counted events from the vCPU's own time.
//!
//! - **Guest time** is what the VMX-preemption timer counted down between the VM entry and the
//!   exit (the run loop writes its value at every entry and the exit saves what is left: SDM
//!   Vol. 3C §26.5.1, §28.3.3 "save VMX-preemption timer value"). The timer counts only in VMX
//!   non-root operation, so this is the guest's run and nothing of the hypervisor's. Unhalted
//!   core cycles and reference cycles are these ticks (the TSC's rate); instructions retired are
//!   too, which is exact where one tick is one instruction (Bochs with `clock: sync=none`) and an
//!   estimate elsewhere (the boot log says which).
//! - **An instruction the hypervisor emulates** (CPUID, RDMSR, WRMSR, an APIC access, ...)
//!   retires in the guest when the hypervisor moves the guest's RIP past it: one instruction, in
//!   the guest's mode, counted with the counters as they are after it (as KVM counts them; so
//!   the WRMSR that enables a counter counts on it, the one that disables it does not).
//! - **`vpmu=domain`** (Du et al.'s *domain switch*) also counts the hypervisor's handling of
//!   the vCPU's exits, from each exit to the next entry (the figure the exit statistics keep), as
//!   OS-mode work; `vpmu=cpu` (*CPU switch*) counts the guest's own run only.
//!
//! **The mode of a run.** Without more, a run counts in the privilege mode of its exit; a run
//! that changes mode without an exit (a system call, an interrupt taken and returned from) is
//! counted wholly in one. That does not matter while every enabled counter counts both modes.
//! When one counts one mode only (`instructions:u`: [`VirtualPmu::mode_sensitive`]), the run
//! loop makes every change of mode an exit (`vm/vpmu.rs`: the vCPU runs on one of two EPTs, each
//! executable only on the code pages seen run in its mode), and [`VcpuPmu::set_split`] tells
//! this model the mode, which is then exact.
//!
//! An overflow with its interrupt enabled asks for a PMI, which the run loop delivers through
//! the vCPU's local APIC (`Lapic::performance_interrupt`). The guest is stopped near its next
//! PMI-enabled wrap by the same VMX-preemption timer that takes the host's samples
//! ([`VcpuPmu::ticks_to_next`]). A PMI is delivered only after the guest ran
//! [`VcpuPmu::min_gap`] ticks of its own time since the last one: a guest that programs a period
//! of 1 gets its PMIs at that rate and still moves on between them (counting in the guest's time,
//! not the TSC's: its PMI handler's exits cost thousands of ticks each, and a limit in TSC time
//! would let the next PMI in as soon as the handler returned). The overflows in between are held
//! in IA32_PERF_GLOBAL_STATUS (the PMI is one line, as on hardware), and the storm's exits cost
//! that vCPU's own slices and budget only.

use crate::vm_config::Vpmu;
use hvprof_pmu::hardware_vpmu::{self, Placement};
use hvprof_pmu::probe::{MsrAccess, MsrFault};
use hvprof_pmu::virtual_pmu::{Slice, VirtualPmu};

/// The most PMIs a vCPU gets per second of its own running time (one per 10 µs of guest time):
/// Linux's own default limit (`kernel.perf_event_max_sample_rate`).
pub const MAX_PMI_RATE: u64 = 100_000;

/// The fewest guest ticks between two PMIs, whatever the TSC's rate: room for a PMI handler of a
/// few hundred instructions (on a slow clock, as Bochs' 4 MHz, a tenth of `MAX_PMI_RATE`'s gap
/// would be shorter than the handler, and a period of 1 would leave the guest no time between
/// one handler and the next).
pub const MIN_PMI_GAP: u64 = 400;

/// The least a guest runs before the PMU stops it again (a PMI's skid, at most): a timer of a
/// tick or two may expire before the guest's first instruction (Bochs counts the VM entry's own
/// tick), and a guest stopped that way would never reach the wrap it waits for.
pub const MIN_RUN: u64 = 64;

/// What a vCPU's virtual PMU counted and delivered (the VM's report prints them, its end frame
/// carries them): the sample log's own type.
pub use hvprof_samplelog::VpmuCounts as VpmuStats;

/// One vCPU's virtual PMU and the state the run loop keeps for it. The model changes through
/// [`VcpuPmu::write_msr`] (and counting), which keeps what the run loop asks at every exit.
#[derive(Clone, Debug)]
pub struct VcpuPmu {
    model: VirtualPmu,
    /// `model.mode_sensitive_except(..)`, as of the last MSR write.
    wants_split: bool,
    mode: Vpmu,
    /// CPL > 0 at the last exit: the mode the guest resumes in.
    user: bool,
    /// An overflow asked for a PMI that is not delivered yet.
    pending: bool,
    /// That PMI was counted as held by the rate limit.
    held_noted: bool,
    /// Guest ticks run since the last PMI was delivered.
    since_pmi: u64,
    /// Guest ticks between two PMIs at least.
    min_gap: u64,
    /// While every change of mode exits: the mode the guest runs in (user: true).
    split: Option<bool>,
    /// The exit being handled is the virtual PMU's ([`VcpuPmu::own_exit`]).
    own_exit: bool,
    /// The hardware backend (`hvprof_pmu::hardware_vpmu`), where the PMU counts: the counters
    /// placed on the real PMU and the profiler's IA32_PERF_GLOBAL_CTRL bits; whether they are
    /// loaded there now; whether the last exit found one of them wrapped.
    hardware: Option<(Placement, u64)>,
    loaded: bool,
    took_overflow: bool,
    pub stats: VpmuStats,
}

impl VcpuPmu {
    /// A PMU after reset, accounting as `mode` (not `Off`), on a TSC of `tsc_hz`.
    pub fn new(mode: Vpmu, tsc_hz: u64) -> VcpuPmu {
        VcpuPmu {
            model: VirtualPmu::new(),
            wants_split: false,
            mode,
            user: false,
            pending: false,
            held_noted: false,
            since_pmi: u64::MAX,
            min_gap: (tsc_hz / MAX_PMI_RATE).max(MIN_PMI_GAP),
            split: None,
            own_exit: false,
            hardware: None,
            loaded: false,
            took_overflow: false,
            stats: VpmuStats::default(),
        }
    }

    pub fn mode(&self) -> Vpmu {
        self.mode
    }

    /// The guest-facing model (CPUID, RDMSR, RDPMC read it).
    pub fn model(&self) -> &VirtualPmu {
        &self.model
    }

    /// WRMSR of one of the model's MSRs.
    pub fn write_msr(&mut self, index: u32, value: u64) -> Result<(), hvprof_pmu::virtual_pmu::Gp> {
        self.model.write(index, value)?;
        self.wants_split = self.model.mode_sensitive_except(self.real_bits());
        Ok(())
    }

    /// Guest ticks between two PMIs at least.
    pub fn min_gap(&self) -> u64 {
        self.min_gap
    }

    /// The guest ran `ticks` of its own time and exited in user mode (`user`) or not: the run
    /// counts in the mode of its exit, or in the mode it ran in while every change of mode
    /// exits ([`VcpuPmu::set_split`]).
    pub fn guest_ran(&mut self, ticks: u64, user: bool) {
        let user = self.split.unwrap_or(user);
        self.user = user;
        self.stats.guest_ticks += ticks;
        self.since_pmi = self.since_pmi.saturating_add(ticks);
        self.count(Slice {
            user,
            instructions: ticks,
            core_cycles: ticks,
            ref_cycles: ticks,
        });
    }

    /// Whether the counters need every change of mode to exit (an enabled counter counts in one
    /// mode only).
    pub fn wants_split(&self) -> bool {
        self.wants_split
    }

    /// The mode the guest runs in while every change of mode exits, `None` when they do not.
    pub fn split(&self) -> Option<bool> {
        self.split
    }

    /// Every change of mode exits from now on, the guest being in user mode (`Some(true)`) or
    /// not; or no longer (`None`).
    pub fn set_split(&mut self, split: Option<bool>) {
        self.split = split;
        if let Some(user) = split {
            self.user = user;
        }
    }

    /// The hypervisor emulated one of the guest's instructions, which retired.
    pub fn emulated_instruction(&mut self) {
        self.stats.emulated += 1;
        self.count(Slice {
            user: self.user,
            instructions: 1,
            ..Slice::default()
        });
    }

    /// The exit being handled is the virtual PMU's: an access to its MSRs, RDPMC, a stop for a
    /// counter's wrap or a held PMI, a change of mode. Its ticks are booked as the vPMU's cost.
    pub fn own_exit(&mut self) {
        self.own_exit = true;
    }

    /// The hypervisor worked `ticks` on one of the vCPU's exits: counted in `vpmu=domain`, as
    /// OS-mode time; booked as the vPMU's cost if it was its own exit.
    pub fn hypervisor_worked(&mut self, ticks: u64) {
        if core::mem::take(&mut self.own_exit) {
            self.stats.exits += 1;
            self.stats.exit_ticks += ticks;
        }
        if self.mode != Vpmu::Domain {
            return;
        }
        self.stats.hypervisor_ticks += ticks;
        self.count(Slice {
            user: false,
            instructions: ticks,
            core_cycles: ticks,
            ref_cycles: ticks,
        });
    }

    /// The counters the real PMU counts (their IA32_PERF_GLOBAL_CTRL bits; 0: every counter is
    /// emulated).
    fn real_bits(&self) -> u64 {
        self.hardware.map_or(0, |(p, _)| p.global_bits())
    }

    /// Runs the counters `p` places on the real PMU there (`host`: the profiler's
    /// IA32_PERF_GLOBAL_CTRL bits, kept on).
    pub fn set_hardware(&mut self, p: Placement, host: u64) {
        self.hardware = Some((p, host));
        // The placed counters tell the modes apart by themselves.
        self.wants_split = self.model.mode_sensitive_except(self.real_bits());
    }

    /// Whether the hardware backend runs some of its counters.
    pub fn hardware(&self) -> bool {
        self.hardware.is_some()
    }

    /// IA32_PERF_GLOBAL_CTRL for the VM-entry and VM-exit load controls, with the hardware
    /// backend.
    pub fn global_ctrl(&self) -> Option<(u64, u64)> {
        let (p, host) = self.hardware?;
        Some(hardware_vpmu::global_ctrl(
            &self.model,
            p,
            host,
            self.mode == Vpmu::Domain,
        ))
    }

    /// The vCPU is loaded on a pCPU: its placed counters onto the real PMU.
    pub fn load_real(&mut self, msrs: &mut impl MsrAccess) -> Result<(), MsrFault> {
        if let Some((p, host)) = self.hardware
            && !self.loaded
        {
            // The guest's counters off until the VM entry enables them (`load`'s contract; the
            // profiler's sampler keeps the reset value's general enables, and a vCPU in domain
            // mode leaves its own on).
            msrs.write(hvprof_pmu::probe::msr::IA32_PERF_GLOBAL_CTRL, host)?;
            hardware_vpmu::load(&self.model, p, msrs)?;
            self.loaded = true;
        }
        Ok(())
    }

    /// The vCPU leaves its pCPU (or the model is about to be read or written): its placed
    /// counters back from the real PMU.
    pub fn save_real(&mut self, msrs: &mut impl MsrAccess) -> Result<(), MsrFault> {
        if let Some((p, _)) = self.hardware
            && self.loaded
        {
            self.loaded = false;
            if hardware_vpmu::save(&mut self.model, p, msrs)? {
                self.pending = true;
            }
        }
        Ok(())
    }

    /// At an exit: a placed counter that wrapped on the real PMU asks for its PMI. What the last
    /// exit found is forgotten first ([`VcpuPmu::took_overflow`] answers for this exit only).
    pub fn take_real_overflow(&mut self, msrs: &mut impl MsrAccess) -> Result<(), MsrFault> {
        self.took_overflow = false;
        if let Some((p, _)) = self.hardware
            && self.loaded
            && let Some(pmi) = hardware_vpmu::take_overflow(&mut self.model, p, msrs)?
        {
            self.took_overflow = true;
            self.pending |= pmi;
        }
        Ok(())
    }

    /// Whether the last exit found a placed counter wrapped (its NMI was the guest's), once.
    pub fn took_overflow(&mut self) -> bool {
        core::mem::take(&mut self.took_overflow)
    }

    fn count(&mut self, slice: Slice) {
        if self.model.counting() && self.model.count_except(&slice, self.real_bits()) {
            self.pending = true;
        }
    }

    /// Before a VM entry: whether a PMI is to be delivered now (the caller hands it to the local
    /// APIC and says with [`VcpuPmu::undelivered`] if nobody took it).
    pub fn take_pmi(&mut self) -> bool {
        if !self.pending {
            return false;
        }
        if self.since_pmi < self.min_gap {
            if !self.held_noted {
                self.held_noted = true;
                self.stats.held += 1;
            }
            return false;
        }
        self.pending = false;
        self.held_noted = false;
        self.since_pmi = 0;
        self.stats.pmis += 1;
        true
    }

    /// At a HLT: a PMI that waits (for the rate limit, which counts guest time a halted vCPU
    /// does not run) is due now, or the vCPU would sleep through it.
    pub fn take_pmi_at_halt(&mut self) -> bool {
        self.since_pmi = self.since_pmi.max(self.min_gap);
        self.take_pmi()
    }

    /// The PMI [`VcpuPmu::take_pmi`] gave found no taker.
    pub fn undelivered(&mut self) {
        self.stats.pmis -= 1;
        self.stats.undelivered += 1;
    }

    /// How many ticks the guest may run before the run loop must look at the PMU again: until
    /// a held PMI may go, or until the first counter that interrupts on its wrap in the mode the
    /// guest resumes in would wrap (a guest tick is one event of each kind), at least
    /// [`MIN_RUN`]; `None`: nothing to wait for.
    pub fn ticks_to_next(&self) -> Option<u64> {
        if self.pending {
            return Some((self.min_gap - self.since_pmi.min(self.min_gap)).max(MIN_RUN));
        }
        if !self.model.counting() {
            return None;
        }
        self.model
            .events_to_pmi_except(self.user, self.real_bits())
            .map(|n| n.max(MIN_RUN))
    }

    /// RDPMC at the guest's CPL `cpl` with its CR4.PCE `pce` (SDM Vol. 2B, RDPMC: "when CR4.PCE
    /// is clear, RDPMC executes only at privilege level 0"; the CPU checks this before the VM
    /// exit, §26.1.1, and the handler checks again rather than trust it). `None`: #GP(0).
    pub fn rdpmc(&self, ecx: u32, cpl: u8, pce: bool) -> Option<u64> {
        if cpl != 0 && !pce {
            return None;
        }
        self.model.rdpmc(ecx).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hvprof_pmu::probe::msr;
    use hvprof_pmu::{evtsel, fixed_ctrl};

    const HZ: u64 = 4_000_000;

    /// Fixed counter 0 (instructions) counting `os`/`usr` with a PMI, enabled globally.
    fn instructions(p: &mut VcpuPmu, bits: u64) {
        p.write_msr(msr::IA32_FIXED_CTR_CTRL, bits).unwrap();
        p.write_msr(msr::IA32_PERF_GLOBAL_CTRL, 1 << 32).unwrap();
    }

    #[test]
    fn guest_time_and_emulated_instructions_count_in_their_mode() {
        let mut p = VcpuPmu::new(Vpmu::Cpu, HZ);
        instructions(&mut p, fixed_ctrl::USR);
        p.guest_ran(1000, false);
        assert_eq!(
            p.model.read(msr::IA32_FIXED_CTR0),
            Ok(0),
            "kernel time: USR only"
        );
        p.guest_ran(700, true);
        p.emulated_instruction();
        assert_eq!(p.model.read(msr::IA32_FIXED_CTR0), Ok(701));
        // The hypervisor's work counts in domain mode only, and as OS time.
        p.hypervisor_worked(500);
        assert_eq!(p.model.read(msr::IA32_FIXED_CTR0), Ok(701));
        assert_eq!(p.stats.hypervisor_ticks, 0);
        let mut d = VcpuPmu::new(Vpmu::Domain, HZ);
        instructions(&mut d, fixed_ctrl::OS);
        d.guest_ran(100, false);
        d.hypervisor_worked(500);
        assert_eq!(d.model.read(msr::IA32_FIXED_CTR0), Ok(600));
        assert_eq!((d.stats.guest_ticks, d.stats.hypervisor_ticks), (100, 500));
    }

    #[test]
    fn a_wrap_asks_for_one_pmi_and_the_next_waits_for_the_guest_to_run_the_gap() {
        let mut p = VcpuPmu::new(Vpmu::Cpu, HZ);
        let gap = p.min_gap();
        assert_eq!(gap, MIN_PMI_GAP, "4 MHz: the floor");
        assert_eq!(
            VcpuPmu::new(Vpmu::Cpu, 3_000_000_000).min_gap(),
            30_000,
            "3 GHz: 10 µs"
        );
        assert!(gap > 2 * MIN_RUN);
        instructions(&mut p, fixed_ctrl::OS | fixed_ctrl::PMI);
        // 100 events before the wrap: the guest may run 100 ticks; 10 before it, `MIN_RUN`.
        p.write_msr(msr::IA32_FIXED_CTR0, (1 << 48) - 100).unwrap();
        assert_eq!(p.ticks_to_next(), Some(100));
        p.write_msr(msr::IA32_FIXED_CTR0, (1 << 48) - 10).unwrap();
        assert_eq!(p.ticks_to_next(), Some(MIN_RUN));
        assert!(!p.take_pmi());
        p.guest_ran(12, false);
        assert_eq!(p.model.read(msr::IA32_PERF_GLOBAL_STATUS), Ok(1 << 32));
        assert!(p.take_pmi(), "the first PMI goes at once");
        assert!(!p.take_pmi(), "one PMI for one wrap");
        // A period of 1: the counter wraps at once, again and again (the handler's own emulated
        // instructions wrap it); the next PMI waits until the guest ran the gap, however long
        // the hypervisor took meanwhile.
        p.write_msr(msr::IA32_FIXED_CTR0, (1 << 48) - 1).unwrap();
        p.emulated_instruction();
        assert!(!p.take_pmi(), "held");
        assert_eq!(p.ticks_to_next(), Some(gap));
        p.guest_ran(gap / 2, false);
        assert!(!p.take_pmi());
        assert_eq!(p.ticks_to_next(), Some(gap - gap / 2));
        p.write_msr(msr::IA32_FIXED_CTR0, (1 << 48) - 1).unwrap();
        p.guest_ran(gap - gap / 2, false);
        assert!(p.take_pmi(), "one PMI for both wraps");
        assert_eq!((p.stats.pmis, p.stats.held), (2, 1));
        p.undelivered();
        assert_eq!((p.stats.pmis, p.stats.undelivered), (1, 1));
        // A PMI held by the limit goes at a HLT: the halted vCPU runs no guest time.
        p.write_msr(msr::IA32_FIXED_CTR0, (1 << 48) - 1).unwrap();
        p.guest_ran(1, false);
        assert!(!p.take_pmi(), "held");
        assert!(p.take_pmi_at_halt());
        assert!(!p.take_pmi_at_halt(), "nothing more to give");
    }

    #[test]
    fn nothing_to_wait_for_without_an_interrupting_counter_in_the_mode() {
        let mut p = VcpuPmu::new(Vpmu::Cpu, HZ);
        assert_eq!(p.ticks_to_next(), None);
        // General counter 0 counts user-mode instructions with INT; the guest is in the kernel.
        let sel = evtsel::EN | evtsel::USR | evtsel::INT | 0xc0;
        p.write_msr(msr::IA32_PERFEVTSEL0, sel).unwrap();
        p.write_msr(msr::IA32_PERF_GLOBAL_CTRL, 1).unwrap();
        assert_eq!(p.ticks_to_next(), None);
        p.guest_ran(5, true);
        assert_eq!(p.ticks_to_next(), Some((1 << 48) - 5));
    }

    #[test]
    fn with_every_mode_change_an_exit_a_run_counts_in_the_mode_it_ran_in() {
        let mut p = VcpuPmu::new(Vpmu::Cpu, HZ);
        instructions(&mut p, fixed_ctrl::USR);
        assert!(p.wants_split(), "instructions:u");
        // A user run that ended at the first kernel instruction (the exit finds CPL 0): user.
        p.set_split(Some(true));
        p.guest_ran(500, false);
        assert_eq!(p.model.read(msr::IA32_FIXED_CTR0), Ok(500));
        // Then the kernel's run, whatever the exit's CPL.
        p.set_split(Some(false));
        p.guest_ran(300, true);
        p.emulated_instruction();
        assert_eq!(p.model.read(msr::IA32_FIXED_CTR0), Ok(500));
        // Without the split, the exit's mode again.
        p.set_split(None);
        p.guest_ran(7, true);
        assert_eq!(p.model.read(msr::IA32_FIXED_CTR0), Ok(507));
        instructions(&mut p, fixed_ctrl::USR | fixed_ctrl::OS);
        assert!(!p.wants_split(), "both modes");
    }

    #[test]
    fn the_vpmus_own_exits_are_booked_as_its_cost() {
        let mut p = VcpuPmu::new(Vpmu::Cpu, HZ);
        p.hypervisor_worked(1000);
        p.own_exit();
        p.hypervisor_worked(700);
        p.hypervisor_worked(300);
        assert_eq!((p.stats.exits, p.stats.exit_ticks), (1, 700));
    }

    /// MSRs that keep what is written (IA32_A_PMCx read as IA32_PMCx) and count nothing.
    #[derive(Default)]
    struct Msrs(std::collections::HashMap<u32, u64>);

    impl MsrAccess for Msrs {
        fn read(&mut self, m: u32) -> Result<u64, MsrFault> {
            Ok(self.0.get(&m).copied().unwrap_or(0))
        }
        fn write(&mut self, m: u32, v: u64) -> Result<(), MsrFault> {
            let m = if (msr::IA32_A_PMC0..msr::IA32_A_PMC0 + 4).contains(&m) {
                m - msr::IA32_A_PMC0 + msr::IA32_PMC0
            } else {
                m
            };
            if m == msr::IA32_PERF_GLOBAL_OVF_CTRL {
                *self.0.entry(msr::IA32_PERF_GLOBAL_STATUS).or_default() &= !v;
            } else {
                self.0.insert(m, v);
            }
            Ok(())
        }
    }

    #[test]
    fn with_the_hardware_backend_the_placed_counters_are_the_real_ones() {
        let (eax, _, _, edx) = VirtualPmu::new().cpuid();
        let info = hvprof_pmu::probe::PmuInfo::from_cpuid(eax, edx);
        let placement = Placement::new(
            &info,
            true,
            Some(hvprof_pmu::sampler::CounterChoice::Fixed(2)),
        );
        let mut p = VcpuPmu::new(Vpmu::Cpu, HZ);
        p.set_hardware(placement, 1 << 34);
        // Instructions (fixed 0, placed) and reference cycles (fixed 2, the host's: emulated).
        p.write_msr(
            msr::IA32_FIXED_CTR_CTRL,
            fixed_ctrl::OS | fixed_ctrl::OS << 8,
        )
        .unwrap();
        p.write_msr(msr::IA32_PERF_GLOBAL_CTRL, 0b101 << 32)
            .unwrap();
        assert_eq!(p.global_ctrl(), Some((1 << 34 | 1 << 32, 1 << 34)));
        // Fixed 2, emulated, counts ring 0 only: changes of mode must exit for it; fixed 0 alone
        // would not need it (the real counter tells the modes apart).
        assert!(p.wants_split());
        let mut alone = VcpuPmu::new(Vpmu::Cpu, HZ);
        alone.set_hardware(placement, 1 << 34);
        alone
            .write_msr(msr::IA32_FIXED_CTR_CTRL, fixed_ctrl::OS)
            .unwrap();
        alone
            .write_msr(msr::IA32_PERF_GLOBAL_CTRL, 1 << 32)
            .unwrap();
        assert!(!alone.wants_split());
        let mut real = Msrs::default();
        p.load_real(&mut real).unwrap();
        // The guest's run: the real counter moves by itself; the model counts only fixed 2.
        real.0.insert(msr::IA32_FIXED_CTR0, 1234);
        p.guest_ran(100, false);
        // A real wrap of fixed 0, with its PMI bit clear: status, no PMI; taken once.
        real.0
            .insert(msr::IA32_PERF_GLOBAL_STATUS, 1 << 32 | 1 << 34);
        p.take_real_overflow(&mut real).unwrap();
        assert!(p.took_overflow() && !p.took_overflow());
        assert_eq!(
            real.0[&msr::IA32_PERF_GLOBAL_STATUS],
            1 << 34,
            "the host's bit stays"
        );
        p.save_real(&mut real).unwrap();
        assert_eq!(p.model().read(msr::IA32_FIXED_CTR0), Ok(1234));
        assert_eq!(p.model().read(msr::IA32_FIXED_CTR0 + 2), Ok(100));
        assert_eq!(p.model().read(msr::IA32_PERF_GLOBAL_STATUS), Ok(1 << 32));
        assert!(!p.take_pmi());
    }

    #[test]
    fn rdpmc_needs_cr4_pce_outside_ring_0() {
        let mut p = VcpuPmu::new(Vpmu::Cpu, HZ);
        p.write_msr(msr::IA32_PMC0, 1234).unwrap();
        assert_eq!(p.rdpmc(0, 0, false), Some(1234));
        assert_eq!(p.rdpmc(0, 3, false), None);
        assert_eq!(p.rdpmc(0, 3, true), Some(1234));
        assert_eq!(p.rdpmc(9, 0, false), None, "no counter 9");
    }
}
