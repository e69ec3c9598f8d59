//! Task tracking: after a sample of a Linux guest, the task its vCPU runs, read from guest memory
//! (`hvprof_hypervisor::profiler::guest_walk`), and a task-change record when it is another one.

use crate::profiler::sampler::{CpuProfiler, GuestSampled};
use crate::tsc::rdtsc;
use crate::vcpu::Vcpu;
use crate::vm::Vm;
use hvprof_hypervisor::guest_ram::RamWord;
use hvprof_hypervisor::profiler::guest_maps::ProcessIndex;
use hvprof_hypervisor::profiler::guest_walk::{self, NameState, SameTask};
use hvprof_samplelog::TaskOffsets;
use hvprof_vmx::instructions::CurrentVmcs;
use hvprof_vmx::vmcs::GuestNatural;

/// IA32_KERNEL_GS_BASE (SDM Vol. 4, Table 2-2).
const KERNEL_GS_BASE: u32 = 0xc000_0102;

/// After any guest sample (the deadline clock's, the PMU's) by `prof` (this pCPU's profiler): a
/// Linux guest's task is tracked (`track_task`), its time counted as the profiler's
/// (`task_reads`), from the sample path's end. Returns that time in ticks (0 for a guest whose
/// tasks are not read, whose samples pay for no more than this test: inlined, it is the only
/// part of this on their path).
#[inline(always)]
pub fn after_guest_sample(
    prof: &CpuProfiler,
    vm: &Vm,
    vcpu: &mut Vcpu,
    vmcs: &CurrentVmcs,
    sampled: &GuestSampled,
) -> u64 {
    let Some(off) = &vm.task_offsets else {
        return 0;
    };
    track_task(vm, vcpu, vmcs, sampled, off);
    let ticks = rdtsc() - sampled.end;
    prof.costs.task_reads.add(ticks);
    ticks
}

/// After a sample of a Linux guest: reads the task its vCPU runs (`guest_walk::read_task`) and,
/// when it is not the one seen at the vCPU's previous sample, records the change for the log.
/// The task's address, pid and name are compared, so a task structure reused by a new process
/// (or a CR3 reused by one) still shows as a change, and so does an exec().
///
/// Inlined: the common case, the same task as at the last sample, is the vCPU's
/// `guest_walk::SameTask` check (the per-CPU base and address space compared, two words loaded
/// through the host addresses it keeps and compared, two more while the name is not settled)
/// and the sample's address checked (`check_rip`); anything else is `task_seen`'s, out of line.
#[inline(always)]
fn track_task(
    vm: &Vm,
    vcpu: &mut Vcpu,
    vmcs: &CurrentVmcs,
    sampled: &GuestSampled,
    off: &TaskOffsets,
) {
    let GuestSampled {
        rip, cr3, cpl, tsc, ..
    } = *sampled;
    // The kernel's per-CPU base: GS base in kernel mode, IA32_KERNEL_GS_BASE (the guest's
    // value, live on this CPU while the vCPU is loaded) in user mode.
    let base = if cpl == 0 {
        // Right after a guest sample, in the run loop or the NMI exit's handler, with this
        // vCPU's VMCS current (so the field is its guest's); any value it could yield is only a
        // guest address, read within the VM's memory (`read_task_ids` refuses a user-half one).
        vmcs.read_fast(GuestNatural::GsBase)
    } else {
        // IA32_KERNEL_GS_BASE exists on every 64-bit processor (SDM Vol. 4, Table 2-2): a plain
        // RDMSR, its value taken as it is (only ever a guest address, read within the VM's
        // memory, as above; not checked canonical as a `VirtAddr`).
        // SAFETY: reading this MSR has no side effects, and it exists (above).
        unsafe { x86_64::registers::model_specific::Msr::new(KERNEL_GS_BASE).read() }
    };
    // Same task, same ids, same address space: same name, so no need to read it again. Except
    // inside an exec: the kernel switches the address space (`exec_mmap`) before it renames the
    // task (`__set_task_comm`), so a kernel-mode sample that sees a task's new address space may
    // still see its old name; the name is then checked at each sample (its two words, in
    // `SameTask`) until `guest_walk::name_state` settles it (a user-mode sample; a kernel thread,
    // which never execs, at once).
    let space = cr3 & vcpu.space_mask;
    let user = cpl == 3;
    if let Some(same) = vcpu.same_task
        && same.holds(base, space, user, RamWord::read)
    {
        check_rip(vm, vcpu, rip, user, space, same.ids(), tsc);
        return;
    }
    // No per-CPU area yet (the kernel's decompressor, its first steps): no task to read.
    if base < guest_walk::KERNEL_HALF {
        return;
    }
    task_seen(vm, vcpu, off, base, rip, cr3, user, tsc);
}

/// [`track_task`] when the quick check did not find the last task: the task read in full and,
/// when it is another one or its name is not settled, its name read, its process entered in the
/// VM's table of maps (and its map read when new), and the change recorded for the log.
#[inline(never)]
#[allow(clippy::too_many_arguments)]
fn task_seen(
    vm: &Vm,
    vcpu: &mut Vcpu,
    off: &TaskOffsets,
    percpu_base: u64,
    rip: u64,
    cr3: u64,
    user: bool,
    tsc: u64,
) {
    let read_phys = |gpa: u64| vm.read_guest_u64(gpa);
    let read_bytes = |gpa: u64, buf: &mut [u8]| vm.read_guest(gpa, buf);
    vcpu.same_task = None;
    // A guest that isolates its page tables (KPTI) runs user mode on the user PGD of a pair,
    // which maps little of its kernel: the first user-mode sample that tells decides for the VM
    // (`guest_walk::isolation_shown`); from then on the kernel's PGD of the pair is the address
    // space of both modes and the root every read goes through (`guest_walk::space_mask`).
    if user
        && vm.isolation.get().is_none()
        && let Some(isolating) = guest_walk::isolation_shown(&read_phys, cr3, percpu_base, off)
    {
        vm.isolation.call_once(|| isolating);
    }
    vcpu.space_mask = guest_walk::space_mask(vm.isolation.get() == Some(&true));
    let space = cr3 & vcpu.space_mask;
    let Some(ids) = guest_walk::read_task_ids(
        &mut vcpu.tlb,
        &read_phys,
        &read_bytes,
        space,
        percpu_base,
        off,
    ) else {
        return;
    };
    // The check of the next samples, from the words this read kept.
    let ram = vm.ram();
    let word = |gpa| ram.word(gpa);
    if vcpu
        .last_task
        .is_some_and(|(i, s, _, state)| i == ids && s == space && state == NameState::Settled)
    {
        vcpu.same_task = SameTask::new(&vcpu.tlb, percpu_base, space, off, ids, None, word);
        check_rip(vm, vcpu, rip, user, space, ids, tsc);
        return;
    }
    let Some(comm) =
        guest_walk::read_task_comm(&mut vcpu.tlb, &read_phys, &read_bytes, space, ids.0, off)
    else {
        return;
    };
    let changed = vcpu
        .last_task
        .is_none_or(|(i, _, c, _)| i != ids || c != comm);
    let kernel_thread = || {
        vm.mm_layout.as_ref().is_some_and(|l| {
            guest_walk::read_task_u64(
                &mut vcpu.tlb,
                &read_phys,
                &read_bytes,
                space,
                ids.0,
                l.task_mm,
            ) == Some(0)
        })
    };
    let state = guest_walk::name_state(vcpu.last_task, ids, space, user, kernel_thread);
    let moved = vcpu.last_task.is_some_and(|(_, s, _, _)| s != space);
    vcpu.last_task = Some((ids, space, comm, state));
    // (An unsettled name is checked too: a kernel-mode sample that finds it unchanged, the same
    // task in the same space, would change nothing here.)
    let unsettled = (state == NameState::UntilUser).then_some(comm);
    vcpu.same_task = SameTask::new(&vcpu.tlb, percpu_base, space, off, ids, unsettled, word);
    let (task, pid, tgid) = ids;
    // A new process, or one in a new address space (an exec, even of a program of the same
    // name): its map is read now (a re-read of the same task's name in the same space changes
    // nothing here).
    if (changed || moved) && (vm.mm_layout.is_some() || vm.module_layout.is_some()) {
        vcpu.maps_process = None;
        vcpu.settled_range = crate::vcpu::NO_RANGE;
        let entered = {
            let mut maps = vm.maps.lock();
            // (Under isolation, the kernel's PGD of the pair: it maps both halves.)
            maps.kernel_cr3 = space;
            maps.enter(tgid, space)
        };
        if let Some((process, new)) = entered {
            vcpu.maps_process = Some(process);
            if new && let Some(layout) = &vm.mm_layout {
                // (Inside an exec the program may not be mapped yet: the first user-mode sample
                // outside what this read found reads it again.)
                read_mappings(vm, vcpu, layout, space, task, tgid, process, tsc);
            }
        }
    }
    check_rip(vm, vcpu, rip, user, space, ids, tsc);
    if !changed {
        return;
    }
    let len = comm.iter().position(|&b| b == 0).unwrap_or(comm.len());
    let name = core::str::from_utf8(&comm[..len]).unwrap_or("?");
    crate::profiler::sampler::this_cpu().task_changed(hvprof_samplelog::Task {
        pcpu: crate::percpu::index() as u16,
        tsc,
        vm: vm.index,
        vcpu: vcpu.index,
        cr3,
        task,
        pid,
        tgid,
        comm: hvprof_samplelog::FixedStr::truncated(name),
    });
}

/// The sample's address, where it shows the guest has mapped code hvprof has not read yet:
/// - a user-mode sample outside every executable range known for its process (a library the
///   dynamic loader or `dlopen` mapped after the process was first read): its map is read again,
///   within the process's allowance (`guest_maps::MAX_REREADS`); an address still in no file
///   mapping is remembered, so it costs no further read;
/// - a kernel-mode sample in the module area outside every module known (a module loaded since
///   the last read): the module list is read (`guest_maps::MAX_MODULE_READS` per VM), so a
///   module unloaded before the end of the run is still named.
///
/// Inlined to its first test: a kernel-mode sample outside the module area (most of a Linux
/// guest's kernel samples) costs no call.
#[inline(always)]
fn check_rip(
    vm: &Vm,
    vcpu: &mut Vcpu,
    rip: u64,
    user: bool,
    space: u64,
    ids: guest_walk::TaskIds,
    tsc: u64,
) {
    use hvprof_hypervisor::profiler::guest_maps::MODULE_AREA;
    if user {
        // Inside the range this vCPU keeps for its process: nothing to read (no lock taken).
        let (start, end) = vcpu.settled_range;
        if !(start..end).contains(&rip) {
            check_user_rip(vm, vcpu, rip, space, ids, tsc);
        }
    } else if let Some(layout) = &vm.module_layout
        && MODULE_AREA.contains(&rip)
    {
        check_module_rip(vm, layout, rip);
    }
}

/// [`check_rip`] for a kernel-mode sample in the module area.
#[inline(never)]
fn check_module_rip(vm: &Vm, layout: &hvprof_linux_walk::ModuleLayout, rip: u64) {
    if !vm.maps.lock().modules.wants_read(rip) {
        return;
    }
    // The guest's IA32_LSTAR is live on this CPU while its vCPU is loaded.
    let lstar = crate::arch::msr::read_safe(0xc000_0082).unwrap_or(0);
    let (found, _) = read_modules(vm, layout, lstar);
    let mut maps = vm.maps.lock();
    for m in found {
        maps.modules.add(m);
    }
    if !maps
        .modules
        .list
        .iter()
        .any(|m| (m.start..m.end).contains(&rip))
    {
        maps.modules.note_not_module(rip);
    }
}

/// [`check_rip`] for a user-mode sample, in address space `space` (the CR3 as `Vcpu::space_mask`
/// keys it).
#[inline(never)]
fn check_user_rip(
    vm: &Vm,
    vcpu: &mut Vcpu,
    rip: u64,
    space: u64,
    (task, _, tgid): guest_walk::TaskIds,
    tsc: u64,
) {
    let (Some(layout), Some(process)) = (&vm.mm_layout, vcpu.maps_process) else {
        return;
    };
    {
        let mut maps = vm.maps.lock();
        let wanted = if maps.covers(process, rip) {
            maps.wants_id_retry(process)
        } else {
            maps.may_reread(process)
        };
        if !wanted {
            vcpu.settled_range = maps
                .settled_range(process, rip)
                .unwrap_or(crate::vcpu::NO_RANGE);
            return;
        }
    }
    read_mappings(vm, vcpu, layout, space, task, tgid, process, tsc);
    let mut maps = vm.maps.lock();
    if !maps.covers(process, rip) {
        maps.note_unmapped(process, rip);
    }
}

/// Reads the executable file mappings of the process whose task is at `task` through its own
/// address space (`space`: its CR3 as `Vcpu::space_mask` keys it, under isolation the kernel's
/// PGD of the pair, which maps both halves), and keeps them in the VM's table for the end of the
/// run (each mapping once).
/// Bounded by `guest_maps::WALK_READS` guest reads; a walk cut short keeps what it found.
#[allow(clippy::too_many_arguments)]
fn read_mappings(
    vm: &Vm,
    vcpu: &Vcpu,
    layout: &hvprof_linux_walk::MmLayout,
    space: u64,
    task: u64,
    tgid: u32,
    process: ProcessIndex,
    tsc: u64,
) {
    use hvprof_hypervisor::profiler::guest_maps::WALK_READS;
    let read_phys = |gpa: u64| vm.read_guest_u64(gpa);
    let read_bytes = |gpa: u64, buf: &mut [u8]| vm.read_guest(gpa, buf);
    let memory = guest_walk::AddressSpace::new(&read_phys, &read_bytes, space);
    let mut budget = hvprof_linux_walk::Budget::new(WALK_READS);
    let pcpu = crate::percpu::index() as u16;
    let mut found = alloc::vec::Vec::new();
    let walk = hvprof_linux_walk::exec_mappings(&memory, layout, task, &mut budget, &mut |m| {
        let path = core::str::from_utf8(m.path()).unwrap_or("?");
        found.push(hvprof_samplelog::Mapping {
            pcpu,
            tsc,
            vm: vm.index,
            vcpu: vcpu.index,
            kind: hvprof_samplelog::MappingKind::Process,
            cr3: space,
            tgid,
            start: m.start,
            end: m.end,
            pgoff: m.pgoff,
            path: hvprof_samplelog::FixedStr::truncated(path),
            build_id: hvprof_samplelog::BuildId::new(m.build_id()).unwrap_or_default(),
        });
        true
    });
    let mut maps = vm.maps.lock();
    // The first few cut walks, so that a layout that does not fit the kernel shows why: told
    // after the lock is let go, through the VM's rate-limited reports (the guest shapes its
    // maps).
    let cut = walk.stop.map(|stop| {
        maps.walk_cut(process);
        (stop, maps.walks_cut)
    });
    let missing_id = found.iter().any(|m| m.build_id.is_none());
    for m in found {
        maps.add(process, m);
    }
    maps.read_done(process, missing_id);
    drop(maps);
    if let Some((stop, n)) = cut.filter(|&(_, n)| n <= 3) {
        crate::vm_report!(
            vm,
            "the memory map of process {tgid} could not be read whole: {stop:?} after {} mappings{}",
            walk.mappings,
            if n == 3 { " (not reported again)" } else { "" }
        );
    }
}

/// The kernel modules loaded in the VM now, from its module list (at the `modules` symbol moved
/// by the KASLR slide that `lstar` gives), read through the last task's address space, as module
/// mappings, and whether the list was read whole. Bounded by `guest_maps::WALK_READS` reads.
pub fn read_modules(
    vm: &Vm,
    layout: &hvprof_linux_walk::ModuleLayout,
    lstar: u64,
) -> (alloc::vec::Vec<hvprof_samplelog::Mapping>, bool) {
    use hvprof_hypervisor::profiler::guest_maps::WALK_READS;
    let cr3 = vm.maps.lock().kernel_cr3;
    let mut found = alloc::vec::Vec::new();
    if cr3 == 0 || lstar == 0 {
        return (found, false);
    }
    let read_phys = |gpa: u64| vm.read_guest_u64(gpa);
    let read_bytes = |gpa: u64, buf: &mut [u8]| vm.read_guest(gpa, buf);
    let space = guest_walk::AddressSpace::new(&read_phys, &read_bytes, cr3);
    let mut budget = hvprof_linux_walk::Budget::new(WALK_READS);
    let tsc = crate::tsc::rdtsc();
    let walk = hvprof_linux_walk::walk_modules(
        &space,
        layout,
        layout.head(lstar),
        &mut budget,
        &mut |m| {
            let name = core::str::from_utf8(m.name()).unwrap_or("?");
            if m.size > 0 {
                found.push(hvprof_samplelog::Mapping {
                    pcpu: crate::percpu::index() as u16,
                    tsc,
                    vm: vm.index,
                    kind: hvprof_samplelog::MappingKind::Module,
                    start: m.base,
                    end: m.base.saturating_add(u64::from(m.size)),
                    path: hvprof_samplelog::FixedStr::truncated(name),
                    ..hvprof_samplelog::Mapping::default()
                });
            }
            found.len() < 4096
        },
    );
    (found, walk.stop.is_none())
}
