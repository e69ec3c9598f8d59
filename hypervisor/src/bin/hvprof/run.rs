//! The run loop: one slice of a vCPU on this pCPU, from VM entry to VM exit and back, with the
//! profiler's sampling clock (the VMX-preemption timer) and the exits handed to `crate::vmexit`.

use crate::profiler;
use crate::tsc::rdtsc;
use crate::vcpu::Vcpu;
use crate::vm::{Stop, Vm, linux_tasks as tasks};
use crate::vm::{virtual_interrupts, vpmu};
use crate::vmexit;
use alloc::format;
use alloc::string::String;
use core::sync::atomic::Ordering;
use hvprof_samplelog::{EventKind, NO_EXIT, NO_VCPU, NO_VM, OutReason};
use hvprof_vmx::caps::{VmxCaps, ept_cap};
use hvprof_vmx::exit::BasicExit;
use hvprof_vmx::instructions::{self, CurrentVmcs};
use hvprof_vmx::vmcs::{Guest32, VmcsExt};

/// How a slice of a vCPU's time ended.
pub enum SliceEnd {
    /// The slice ran out: the vCPU is still runnable.
    Preempted,
    /// The guest executed HLT: the vCPU blocks until its virtual timer (if any) fires.
    Halted,
    /// The guest spun (a pause-loop exit): the vCPU is runnable and gives up its slice.
    Yielded,
    /// The VM stopped.
    Stopped(Stop),
}

/// Runs vCPU `vcpu` of `vm` on this pCPU (`cpu`) until `slice_end` (TSC), a HLT, or its stop.
/// The VMX-preemption timer stops the guest at the profiler's next sampling deadline, at the end
/// of the slice and at the end of the VM's budget; while the hypervisor handles an exit,
/// interrupts are on and the LAPIC timer takes the samples. With `release`, the VMCS is cleared
/// at the end so that the vCPU may run on another pCPU next.
pub fn run_slice(
    vm: &Vm,
    vcpu: &mut Vcpu,
    cpu: usize,
    release: bool,
    caps: &VmxCaps,
    slice_end: u64,
) -> SliceEnd {
    let here = crate::percpu::this();
    if here.enter_vm(vm.index) {
        crate::isolation::switch_vm(here.selectors().data);
    }
    let moved = vcpu.last_cpu.is_some_and(|c| c != cpu);
    let mut vmcs = match activate(vcpu, cpu, caps) {
        Ok(v) => v,
        Err(e) => return SliceEnd::Stopped(Stop::Fault(e)),
    };
    if moved && vcpu.pmu.is_some() {
        vpmu::after_move(vm, vcpu);
    }
    // From here to the end of the slice an IPI for this vCPU kicks this pCPU and no other.
    let index = usize::from(vcpu.index);
    vm.set_running_on(index, Some(cpu));
    // A vCPU with a virtual PMU runs the loop that feeds it; the others one without any of it.
    let end = if vcpu.pmu.is_some() {
        run_loaded::<true>(vm, vcpu, &mut vmcs, caps, slice_end)
    } else {
        run_loaded::<false>(vm, vcpu, &mut vmcs, caps, slice_end)
    };
    vm.set_running_on(index, None);
    if release {
        // SAFETY: VMX root operation; the VMCS is active on this CPU. VMCLEAR writes its state
        // to memory and makes it inactive, so another CPU may VMPTRLD it (SDM Vol. 3C §25.11.1).
        if let Err(e) = unsafe { instructions::vmclear(vcpu.vmcs) } {
            return SliceEnd::Stopped(Stop::Fault(format!("VMCLEAR failed: {e}")));
        }
        vcpu.launched = false;
        vcpu.host_cpu = None;
    }
    end
}

/// Makes the vCPU's VMCS current on pCPU `cpu`: VMPTRLD, and when the VMCS last held another
/// pCPU's host state (it was cleared there), this pCPU's; when the vCPU last ran elsewhere, its
/// VPID's cached translations here may be stale and are flushed (SDM Vol. 3C §29.4.3.3).
fn activate(vcpu: &mut Vcpu, cpu: usize, caps: &VmxCaps) -> Result<CurrentVmcs, String> {
    if let Some(other) = vcpu.host_cpu.filter(|&c| c != cpu) {
        return Err(format!(
            "scheduler bug: the VMCS is still active on pCPU {other} (not cleared before moving)"
        ));
    }
    // SAFETY: in VMX root operation; the VMCS was prepared by `Vcpu::new` and is active on no
    // other CPU (checked above: a vCPU that may move is cleared at the end of each slice).
    unsafe { instructions::vmptrld(vcpu.vmcs) }.map_err(|e| format!("VMPTRLD failed: {e}"))?;
    // SAFETY: VMX root operation with this vCPU's VMCS current, on this CPU only.
    let mut vmcs = unsafe { CurrentVmcs::new() };
    if vcpu.host_cpu.is_none() {
        crate::vcpu::write_host_cpu_state(&mut vmcs).map_err(|e| format!("{e}"))?;
        vcpu.host_cpu = Some(cpu);
    }
    if vcpu.last_cpu.is_some_and(|c| c != cpu) && caps.ept_cap(ept_cap::INVVPID) {
        let kind = if caps.ept_cap(ept_cap::INVVPID_SINGLE) {
            Some(instructions::InvVpidType::SingleContext)
        } else if caps.ept_cap(ept_cap::INVVPID_ALL) {
            Some(instructions::InvVpidType::AllContext)
        } else {
            None
        };
        if let Some(kind) = kind {
            // SAFETY: VMX root operation; INVVPID of this type is supported (checked above);
            // invalidating cached translations cannot break memory safety.
            unsafe { instructions::invvpid(kind, vcpu.vpid, 0) }
                .map_err(|e| format!("INVVPID failed: {e}"))?;
        }
    }
    vcpu.last_cpu = Some(cpu);
    Ok(vmcs)
}

/// The run loop of `run_slice`, with the VMCS current: each turn prepares the entry, enters the
/// guest and gets its exit decoded, runs the profiler's hooks on the exit, then hands the exit to
/// its handler (`vmexit::handle`), unless it was only the sampling clock's.
fn run_loaded<const PMU: bool>(
    vm: &Vm,
    vcpu: &mut Vcpu,
    vmcs: &mut CurrentVmcs,
    caps: &VmxCaps,
    slice_end: u64,
) -> SliceEnd {
    if let Some(end) = start_up(vm, vcpu, vmcs) {
        return end;
    }
    let mut slice = Slice::<PMU>::begin(vm, vcpu, caps, slice_end);
    let end = loop {
        if let Err(end) = slice.prepare_entry(vm, vcpu, vmcs) {
            break end;
        }
        let exit = match slice.enter(vcpu, vmcs) {
            Ok(exit) => exit,
            Err(end) => break end,
        };
        slice.after_exit(vm, vcpu, vmcs, &exit);
        if slice.sampling_clock_only(&exit) {
            continue;
        }
        if let Err(end) = slice.handle(vm, vcpu, vmcs, exit) {
            break end;
        }
    };
    slice.end(vm, vcpu, end)
}

/// INIT and SIPI: an INIT sends a vCPU that ran back to wait-for-SIPI (a CPU taken offline and
/// brought back online: Linux's CPU hotplug); an application processor starts at its SIPI's
/// vector (the scheduler runs it only then). `Some`: the slice ends before it began.
fn start_up(vm: &Vm, vcpu: &mut Vcpu, vmcs: &mut CurrentVmcs) -> Option<SliceEnd> {
    if vm.apic && vm.take_init(usize::from(vcpu.index)) {
        vcpu.wait_for_sipi = true;
    }
    if vcpu.wait_for_sipi {
        match vm.take_sipi(usize::from(vcpu.index)) {
            Some(vector) => {
                if let Err(e) = start_at_sipi(vcpu, vmcs, vector) {
                    return Some(SliceEnd::Stopped(Stop::Fault(e)));
                }
            }
            None => {
                vcpu.wake_at = None;
                return Some(SliceEnd::Halted);
            }
        }
    }
    None
}

/// A VM exit, decoded: its reason and the TSC right after it.
struct Exit {
    reason: hvprof_vmx::exit::ExitReason,
    tsc: u64,
    /// The VMX-preemption timer's (the sampling clock's, or the slice's, budget's or devices'
    /// deadline).
    preemption: bool,
}

/// One slice's state across the turns of the run loop.
/// `PMU`: the vCPU has a virtual PMU (`vm/vpmu.rs`), which the loop then feeds.
struct Slice<'a, const PMU: bool> {
    prof: &'static profiler::sampler::CpuProfiler,
    caps: &'a VmxCaps,
    shift: u8,
    /// The vCPU's bit in the VM's kicks (`vm::kick_bit`; 0 without a local APIC, whose VM has
    /// no IPIs).
    kick_bit: u64,
    start: u64,
    /// The end of the VM's budget (its own running time, all its vCPUs') and the earlier of it
    /// and its wall budget.
    budget_end: u64,
    deadline: u64,
    /// The end of the slice or the budget (one test of both at each entry), and that or the
    /// devices' next event: the guest's run ends there if no sampling deadline comes first (kept
    /// as they change, not made at each entry).
    slice_or_budget: u64,
    other: u64,
    /// The timer of this entry was set for a sampling deadline that nothing else needed.
    timer_for_sampling: bool,
    /// The timer of this entry was set for the virtual PMU (a counter's wrap, a held PMI).
    timer_for_pmu: bool,
    /// The VMX-preemption timer's value written for this entry (a virtual PMU measures the
    /// guest's run by what the exit leaves of it).
    timer_set: u32,
    /// The last exit's reason and TSC, booked in the exit statistics at the next entry.
    exit_at: Option<(u16, u64)>,
    /// An exit for a sampling deadline (its cost is the profiler's): the TSC it began at, moved
    /// on by any export done inside it (counted as export), and its sample path and task read
    /// ticks.
    sampling_exit: Option<(u64, u64)>,
    /// The LAPIC timer samples the hypervisor while it handles an exit; a sampling exit leaves
    /// it unarmed (nothing runs but the path back into the guest).
    host_clock_armed: bool,
    /// The last exit took the sampling clock's short path (no handler ran).
    short_path: bool,
    /// A guest's devices need a look before an entry when an exit may have changed them
    /// (any exit but the VMX-preemption timer's), when their next event has come, or while an
    /// interrupt waits: not at the sampling clock's exits in between.
    devices_touched: bool,
    device_event: Option<u64>,
}

impl<'a, const PMU: bool> Slice<'a, PMU> {
    #[inline(always)]
    fn begin(vm: &Vm, vcpu: &mut Vcpu, caps: &'a VmxCaps, slice_end: u64) -> Self {
        let prof = profiler::this_cpu();
        vcpu.load_state();
        let start = rdtsc();
        let budget_end = start.saturating_add(
            vm.budget
                .saturating_sub(vm.run_ticks.load(Ordering::Relaxed)),
        );
        let deadline = budget_end.min(vm.wall_deadline.load(Ordering::Relaxed));
        // Test guests keep frame pointers in kernel mode; Linux's kernel does not: its chains
        // are walked by its ORC tables, where the host gave them (`orc-layout=`, which any VM
        // may be given), once the kernel has set IA32_LSTAR (which gives the KASLR slide).
        let kernel_stacks = if vm.linux || vm.orc_layout.is_some() {
            profiler::KernelStacks::Orc
        } else {
            profiler::KernelStacks::FramePointers
        };
        prof.set_guest_memory(Some((vm.index, vm.ram())), kernel_stacks, vm.orc_layout);
        // The vCPU is this pCPU's from its in event on, and the samples say so from the same
        // instant: no timer sample between the two carries the vCPU while its events say it is
        // out (as the out event and `set_current(NO_VM, ..)` in `end`, with interrupts off).
        x86_64::instructions::interrupts::without_interrupts(|| {
            prof.set_current(vm.index, vcpu.index, vcpu.vpid, vcpu.last_exit);
            prof.event(EventKind::VcpuIn, OutReason::Preempted);
        });
        let slice_or_budget = deadline.min(slice_end);
        Slice {
            prof,
            caps,
            shift: caps.preemption_timer_shift(),
            kick_bit: if vm.apic {
                crate::vm::kick_bit(usize::from(vcpu.index))
            } else {
                0
            },
            start,
            budget_end,
            deadline,
            slice_or_budget,
            other: slice_or_budget,
            timer_for_sampling: false,
            timer_for_pmu: false,
            timer_set: 0,
            exit_at: None,
            sampling_exit: None,
            host_clock_armed: true,
            short_path: false,
            devices_touched: true,
            device_event: None,
        }
    }

    /// Before a VM entry: the guest's devices and interrupts, the hypervisor's sample if its
    /// deadline passed, the reasons to end the slice, and the VMX-preemption timer.
    #[inline(always)]
    fn prepare_entry(
        &mut self,
        vm: &Vm,
        vcpu: &mut Vcpu,
        vmcs: &mut CurrentVmcs,
    ) -> Result<(), SliceEnd> {
        let prof = self.prof;
        // Another vCPU's IPI for this one: its local APIC has something new.
        let kicked = vm.take_kicks(self.kick_bit);
        if kicked && vm.take_init(usize::from(vcpu.index)) {
            vcpu.wait_for_sipi = true;
            vcpu.wake_at = None;
            return Err(SliceEnd::Halted);
        }
        // A virtual PMU: its mode EPTs as its counters need them, and its overflow interrupt,
        // when one is due (`vm/vpmu.rs`).
        if PMU {
            let single = self.caps.ept_cap(ept_cap::INVEPT_SINGLE);
            if let Err(e) = vpmu::sync_split(vm, vcpu, vmcs, single)
                .and_then(|()| vpmu::load_hardware(vcpu, vmcs))
            {
                return Err(SliceEnd::Stopped(Stop::Fault(e)));
            }
            if vpmu::deliver_pmi(vm, vcpu) {
                self.devices_touched = true;
            }
        }
        // With the CPU's APIC virtualization, the local APIC's state taken back at an exit goes
        // back to the CPU before the guest runs again (vm/virtual_apic.rs).
        let apic_taken = vcpu.virtual_apic != 0 && !vcpu.apic_handed;
        // A Linux guest's devices: raise what is due, inject what the guest can take now (with
        // interrupts on, so the sampling clock sees this work for what it is). After a sampling
        // exit's short path their next event is not looked for: the VMX-preemption timer was set
        // for it too, so one that came meanwhile ends the next run at once, and its exit looks.
        if vm.delivers_interrupts()
            && (self.devices_touched
                || kicked
                || apic_taken
                || (!self.short_path && self.device_event.is_some_and(|t| rdtsc() >= t)))
        {
            if !self.host_clock_armed {
                prof.arm_host_clock();
                x86_64::instructions::interrupts::enable();
                self.host_clock_armed = true;
            }
            let (next, waiting) =
                virtual_interrupts::before_entry(vm, vcpu, vmcs, self.caps, rdtsc());
            self.device_event = next;
            self.other = self.slice_or_budget.min(next.unwrap_or(u64::MAX));
            self.devices_touched = waiting;
        }
        // Interrupts stay off from here to the VM exit: a tick that falls in this window is
        // taken as a hypervisor sample right here.
        x86_64::instructions::interrupts::disable();
        if self.host_clock_armed {
            prof.disarm_host_clock();
            self.host_clock_armed = false;
        }
        let now = rdtsc();
        // A deadline that passed while the hypervisor worked is its sample, taken here; after a
        // sampling exit's short path none can have (the guest sample just moved the deadline a
        // period on).
        if !self.short_path {
            let here = x86_64::instructions::read_rip().as_u64();
            let _ = prof.sample_host_at(here, profiler::sampler::frame_pointer(), false, now);
        }
        self.short_path = false;
        if vm.stopping.load(Ordering::Acquire) {
            return Err(SliceEnd::Stopped(Stop::WithVm));
        }
        if now >= self.slice_or_budget {
            if now >= self.deadline {
                return Err(SliceEnd::Stopped(if now >= self.budget_end {
                    Stop::Budget
                } else {
                    Stop::WallBudget
                }));
            }
            return Err(SliceEnd::Preempted);
        }
        // The VMX-preemption timer stops the guest at the next sampling deadline, the end of the
        // slice, the end of the budget or its devices' next event, whichever comes first (SDM
        // Vol. 3C §26.5.1).
        // A virtual PMU's next interrupting wrap is one more deadline.
        let tick = prof.next_tick();
        let pmu_at = if PMU {
            vpmu::ticks_to_next(vcpu).map(|n| now.saturating_add(n))
        } else {
            None
        };
        let other = match pmu_at {
            Some(at) => self.other.min(at),
            None => self.other,
        };
        self.timer_for_sampling = tick < other;
        let mut until = tick.min(other).saturating_sub(now);
        // After a sampling exit, the guest runs at least a quarter of a period before the next:
        // with a period shorter than the exits it causes, it would otherwise never run at all.
        // (Not past a virtual PMU's deadline, which keeps its own least run, `MIN_RUN`.) After
        // any other exit the next sample comes at its deadline: a least run there would move
        // the samples that fall soon after the guest's exits later, away from the code that
        // caused them and onto code that runs long without an exit.
        // (`until` is already within a virtual PMU's deadline: `other` holds it.)
        // (The period as it is now: a slice may begin before the profiler does.)
        let least = prof.period() / 4;
        if until < least && self.timer_for_sampling && self.sampling_exit.is_some() {
            until = match pmu_at {
                Some(at) => least.min(at.saturating_sub(now)),
                None => least,
            };
        }
        let mut timer = (until >> self.shift).min(u32::MAX as u64) as u32;
        if PMU {
            self.timer_for_pmu = pmu_at.is_some_and(|at| at < self.other && at <= tick);
            // A timer of 0 exits before the guest's first instruction: a deadline of a few
            // ticks, below the timer's rate, would come back at every entry with nothing run.
            timer = timer.max(1);
            self.timer_set = timer;
        }
        if let Err(e) = vmcs.write32(Guest32::PreemptionTimerValue, timer) {
            return Err(SliceEnd::Stopped(Stop::Fault(format!(
                "VMWRITE of the preemption timer failed: {e}"
            ))));
        }
        Ok(())
    }

    /// VM entry (VMLAUNCH or VMRESUME) to VM exit, and the exit's reason; a failed entry ends
    /// the slice.
    #[inline(always)]
    fn enter(&mut self, vcpu: &mut Vcpu, vmcs: &mut CurrentVmcs) -> Result<Exit, SliceEnd> {
        // The last exit ends at the entry: it is booked after it (in the exit statistics, and as
        // a sampling exit if it was one), so that the booking is the only part of it left out.
        let last_exit = self.exit_at.take();
        let ending = self.sampling_exit.take();
        let t_entry = rdtsc();
        // SAFETY: the VMCS is current and complete (host state is this pCPU's); `launched`
        // tracks VMLAUNCH since the last VMCLEAR.
        let flags = unsafe { crate::vcpu::entry::vmx_run(&mut vcpu.regs, vcpu.launched as u64) };
        let tsc = rdtsc();
        self.prof.set_guest_rbp(vcpu.regs.rbp);
        if let Some((reason, t)) = last_exit {
            vcpu.stats.record(reason, t_entry - t);
            if PMU {
                vpmu::hypervisor_worked(vcpu, t_entry - t);
            }
        }
        if let Some((t, inside)) = ending {
            self.prof.sampling_exit_done(t, t_entry, inside);
        }
        if flags != 0 {
            let why = hvprof_vmx::errors::VmFail::from_rflags(flags, || {
                vmcs.read32(hvprof_vmx::vmcs::ReadOnly32::VmInstructionError)
                    .unwrap_or(0)
            });
            let what = if vcpu.launched {
                "VMRESUME"
            } else {
                "VMLAUNCH"
            };
            return Err(SliceEnd::Stopped(Stop::Fault(match why {
                Err(e) => format!("{what} failed: {e}"),
                Ok(()) => format!("{what} returned with RFLAGS {flags:#x}"),
            })));
        }
        // The exit reason, read without decoding an error, on every exit. VMREAD fails only
        // without a current VMCS or for a field the processor does not have (SDM Vol. 3C §32.3,
        // "VMREAD", Operation); here the VM exit just stored this VMCS's exit reason (§28.2.1),
        // a field of every VMCS (Appendix B.3.2).
        let reason = hvprof_vmx::exit::ExitReason(
            vmcs.read_fast(hvprof_vmx::vmcs::ReadOnly32::ExitReason) as u32,
        );
        if reason.entry_failure() {
            let qual = vmcs.exit_qualification().unwrap_or(0);
            let detail = hvprof_vmx::errors::EntryFailure::decode(reason, qual)
                .map(|f| format!("{f}"))
                .unwrap_or_default();
            return Err(SliceEnd::Stopped(Stop::Fault(format!(
                "VM entry failed: {reason} {detail}"
            ))));
        }
        vcpu.launched = true;
        if PMU {
            vpmu::after_run(vcpu, vmcs, self.timer_set, self.shift);
        }
        if vcpu.mode_switching {
            follow_long_mode(vcpu, vmcs);
        }
        Ok(Exit {
            reason,
            tsc,
            preemption: reason.basic() == BasicExit::PreemptionTimer as u16,
        })
    }

    /// What every exit does before its handler: an event it interrupted put back, the guest
    /// sample if the deadline has come (the preemption timer's exit, or any exit that found it
    /// passed; it carries the previous exit reason, and a Linux guest's running task is read
    /// after it), then this exit becomes the last one.
    #[inline(always)]
    fn after_exit(&mut self, vm: &Vm, vcpu: &mut Vcpu, vmcs: &mut CurrentVmcs, exit: &Exit) {
        // A VMX-preemption timer exit happens between instructions, never while an event is being
        // delivered (SDM Vol. 3C §26.5.1 and §28.2.4: only exits that the delivery itself causes
        // leave valid IDT-vectoring information), so the sampling clock's exits skip the check.
        if !exit.preemption {
            virtual_interrupts::redeliver_interrupted_event(vmcs);
        }
        let mut inside = 0;
        if let Some(sampled) = self.prof.sample_guest_if_due(vmcs, exit.tsc) {
            inside = sampled.cost + tasks::after_guest_sample(self.prof, vm, vcpu, vmcs, &sampled);
        }
        let basic = exit.reason.basic();
        if vcpu.last_exit != basic {
            vcpu.last_exit = basic;
            self.prof
                .set_current(vm.index, vcpu.index, vcpu.vpid, vcpu.last_exit);
        }
        self.exit_at = Some((basic, exit.tsc));
        if PMU
            && exit.preemption
            && self.timer_for_pmu
            && let Some(p) = vcpu.pmu.as_mut()
        {
            p.own_exit();
        }
        if exit.preemption && self.timer_for_sampling {
            self.sampling_exit = Some((exit.tsc, inside));
        }
    }

    /// The sampling clock's exit with nothing else to do: straight back into the guest, unless
    /// the ring or the console has something to move on (done in `handle`, where it is
    /// sampled).
    #[inline(always)]
    fn sampling_clock_only(&mut self, exit: &Exit) -> bool {
        if exit.preemption
            && !profiler::export::wants_drain(self.prof)
            && !crate::console::pump_due(exit.tsc)
        {
            self.short_path = matches!(self.sampling_exit, Some((_, sampled)) if sampled > 0);
            return true;
        }
        false
    }

    /// The exit's handler, with interrupts on (the LAPIC timer samples it), then the export and
    /// the console moved on.
    #[inline(always)]
    fn handle(
        &mut self,
        vm: &Vm,
        vcpu: &mut Vcpu,
        vmcs: &mut CurrentVmcs,
        exit: Exit,
    ) -> Result<(), SliceEnd> {
        self.devices_touched |= !exit.preemption;
        self.prof.arm_host_clock();
        self.host_clock_armed = true;
        x86_64::instructions::interrupts::enable();
        let rip = if PMU {
            vpmu::rip_before(vcpu, vmcs)
        } else {
            None
        };
        let flow = vmexit::handle(vm, vcpu, vmcs, exit.reason);
        if let Some(rip) = rip {
            vpmu::after_handler(vcpu, vmcs, rip);
        }
        x86_64::instructions::interrupts::disable();
        match flow {
            vmexit::Flow::Resume => {}
            vmexit::Flow::Halt => return Err(SliceEnd::Halted),
            vmexit::Flow::Yield => return Err(SliceEnd::Yielded),
            vmexit::Flow::Stop(stop) => return Err(SliceEnd::Stopped(stop)),
        }
        x86_64::instructions::interrupts::enable();
        let export = profiler::export::drain_if_full(self.prof);
        if let Some((t, _)) = &mut self.sampling_exit {
            *t += export;
        }
        crate::console::pump();
        Ok(())
    }

    /// The slice's end: the last exit booked, the vCPU's out event, the VM's running time.
    /// (Inlined, as every method of `Slice`: its fields stay in registers through the loop.)
    #[inline(always)]
    fn end(mut self, vm: &Vm, vcpu: &mut Vcpu, end: SliceEnd) -> SliceEnd {
        let prof = self.prof;
        // With the hardware backend, the vCPU's counters leave the real PMU with it.
        let end = match (PMU, end) {
            (true, end @ SliceEnd::Stopped(_)) => {
                let _ = vpmu::save_hardware(vcpu);
                end
            }
            (true, end) => match vpmu::save_hardware(vcpu) {
                Ok(()) => end,
                Err(e) => SliceEnd::Stopped(Stop::Fault(e)),
            },
            (false, end) => end,
        };
        x86_64::instructions::interrupts::disable();
        if let Some((reason, t)) = self.exit_at.take() {
            let ticks = rdtsc() - t;
            vcpu.stats.record(reason, ticks);
            if PMU {
                vpmu::hypervisor_worked(vcpu, ticks);
            }
        }
        if let Some((t, inside)) = self.sampling_exit.take() {
            prof.sampling_exit_done(t, rdtsc(), inside);
        }
        if self.host_clock_armed {
            prof.disarm_host_clock();
        }
        prof.event(
            EventKind::VcpuOut,
            match end {
                SliceEnd::Preempted => OutReason::Preempted,
                SliceEnd::Halted => OutReason::Halted,
                SliceEnd::Yielded => OutReason::Yielded,
                SliceEnd::Stopped(_) => OutReason::Stopped,
            },
        );
        prof.set_current(NO_VM, NO_VCPU, 0, NO_EXIT);
        prof.set_guest_memory(None, profiler::KernelStacks::None, None);
        vm.run_ticks
            .fetch_add(rdtsc() - self.start, Ordering::Relaxed);
        vcpu.save_state();
        end
    }
}

/// Puts a vCPU that waited for a SIPI in the state the SIPI gives it (SDM Vol. 3A, "MP
/// Initialization Protocol Algorithm" and Table "IA-32 and Intel 64 Processor States Following
/// Power-up, Reset, or INIT"): real mode, CS selector `vector << 8` and base `vector << 12`, IP
/// 0, the other segments at 0 with 64 KiB limits, paging and protection off; which the CPU runs
/// under "unrestricted guest" (SDM Vol. 3C §26.6).
fn start_at_sipi(vcpu: &mut Vcpu, vmcs: &mut CurrentVmcs, vector: u8) -> Result<(), String> {
    use hvprof_hypervisor::guest_image::{BootState, StartMode};
    use hvprof_hypervisor::vmcs_setup;
    use hvprof_vmx::vmcs::{Control32, Guest16, GuestNatural};
    let boot = BootState {
        mode: StartMode::Real16,
        entry: 0,
        rsp: 0,
        cr3: 0,
        gdt_base: 0,
        gdt_limit: 0xffff,
        rax: 0,
        rbx: 0,
        rdi: 0,
        rsi: 0,
        code_selector: 0,
        data_selector: 0,
    };
    let e = |what: &str| format!("SIPI start: {what} failed");
    vmcs_setup::write_guest_state(vmcs, &boot, false).map_err(|_| e("guest state"))?;
    vmcs_setup::write_control_registers(vmcs, &vcpu.fixed, StartMode::Real16, 0)
        .map_err(|_| e("CRs"))?;
    let cs = u16::from(vector) << 8;
    vmcs.write16(Guest16::CsSelector, cs)
        .map_err(|_| e("CS selector"))?;
    vmcs.write_natural(GuestNatural::CsBase, u64::from(cs) << 4)
        .map_err(|_| e("CS base"))?;
    let entry = vmcs
        .read32(Control32::EntryControls)
        .map_err(|_| e("VMREAD entry controls"))?;
    vmcs.write32(
        Control32::EntryControls,
        entry & !hvprof_vmx::caps::entry::IA32E_MODE_GUEST,
    )
    .map_err(|_| e("entry controls"))?;
    vcpu.regs = Default::default();
    vcpu.cr8 = 0;
    vcpu.wait_for_sipi = false;
    vcpu.mode_switching = true;
    Ok(())
}

/// A vCPU on its way from real mode to 64-bit mode: the VM-entry control "IA-32e mode guest"
/// must equal the guest's EFER.LMA at the next entry (SDM Vol. 3C §27.3.1.1), and LMA changes
/// when the guest sets CR0.PG with EFER.LME, which does not exit under unrestricted guest. Once
/// in 64-bit mode (Linux never leaves it), the vCPU is no longer followed.
fn follow_long_mode(vcpu: &mut Vcpu, vmcs: &mut CurrentVmcs) {
    use hvprof_vmx::caps::entry::IA32E_MODE_GUEST;
    use hvprof_vmx::vmcs::{Control32, Guest64};
    const EFER_LMA: u64 = 1 << 10;
    let lma = vmcs.read64(Guest64::Ia32Efer).unwrap_or(0) & EFER_LMA != 0;
    let entry = vmcs.read32(Control32::EntryControls).unwrap_or(0);
    let want = if lma {
        entry | IA32E_MODE_GUEST
    } else {
        entry & !IA32E_MODE_GUEST
    };
    if want != entry {
        let _ = vmcs.write32(Control32::EntryControls, want);
    }
    if lma {
        vcpu.mode_switching = false;
    }
}
