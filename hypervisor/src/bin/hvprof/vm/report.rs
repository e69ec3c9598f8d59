//! What is printed when a VM stops: the rest of its console line, why it stopped, an attack
//! target's page checksum, the guest's IA32_LSTAR, and (at the end of the run) its exit
//! statistics.

use super::{GuestConsole, Stop, Vm, page_checksum};
use crate::profiler;
use crate::tsc::rdtsc;
use crate::vcpu::LSTAR_SLOT;
use crate::{print, println};
use core::fmt::Write;
use core::sync::atomic::Ordering;
use hvprof_hypervisor::spin_sites::SpinSites;
use hvprof_hypervisor::vm_config::Ple;
use hvprof_samplelog::{ExitStats, Output, OutputStream, PauseLoop, SpinSite, VmEnd};
use hvprof_vmx::exit::BasicExit;

/// After a VM's stop (all its vCPUs stopped): the rest of its console line, then why it stopped
/// (`exit_stats` follows at the end of the run).
pub fn finish(vm: &Vm, stop: &Stop) {
    let (lines, bytes, reports) = {
        let mut guard = vm.devices.lock();
        let mut console = vm.console.lock();
        if let Some(rest) = guard.board.uart.flush() {
            console.emit(&vm.name, rest, rdtsc());
        }
        (
            console.lines_dropped,
            console.bytes_dropped,
            console.reports_dropped,
        )
    };
    if reports > 0 {
        println!(
            "vm {}: {reports} of the hypervisor's lines about the VM dropped: the guest caused them faster than {} a second (bursts of {})",
            vm.name,
            GuestConsole::REPORTS_PER_SECOND,
            GuestConsole::REPORT_BURST
        );
    }
    if lines > 0 {
        println!(
            "vm {}: {lines} console lines ({bytes} bytes) dropped: the guest printed faster than the console line carries ({} bytes/s, bursts of {} bytes)",
            vm.name,
            GuestConsole::LINE_BYTES_PER_SECOND,
            GuestConsole::BURST
        );
    }
    report(vm, stop);
    if vm.apic {
        let (ipis, inits, sipis, nmis, io_apic) = {
            let d = vm.devices.lock();
            (d.ipis, d.inits, d.sipis, d.nmis, d.io_apic_messages)
        };
        let mut accesses = 0;
        let mut started = 0;
        let mut injected = 0;
        for v in &vm.vcpus {
            let v = v.lock();
            accesses += v.apic_accesses;
            injected += v.interrupts_injected;
            started += usize::from(v.index > 0 && !v.wait_for_sipi);
        }
        // With the CPU's APIC virtualization most accesses and every edge-triggered interrupt
        // need no VM exit: the counts are of those that did.
        let how = if vm.apic_access != 0 {
            " (APIC virtualization: only the accesses that exited; the CPU delivered the local APICs' interrupts)"
        } else {
            ""
        };
        println!(
            "vm {}: local APICs: {accesses} register accesses, {ipis} IPIs sent ({inits} INIT, {sipis} SIPI, {nmis} NMI), {started} of {} application processors started, {injected} interrupts injected, {io_apic} I/O APIC interrupts{how}",
            vm.name,
            vm.vcpus.len() - 1
        );
    }
    if vm.linux {
        // The guest kernel's system-call entry: with the offline symbols it gives the KASLR
        // slide (`entry_SYSCALL_64` moves with the kernel), for hvprof-analyze.
        let lstar = vm.vcpus[0].lock().msrs[LSTAR_SLOT];
        println!("vm {}: guest IA32_LSTAR {lstar:#018x}", vm.name);
        if vm.isolation.get() == Some(&true) {
            println!(
                "vm {}: the guest isolates its page tables (KPTI): a user-mode CR3 was read as its kernel PGD's address space",
                vm.name
            );
        }
    }
}

fn report(vm: &Vm, stop: &Stop) {
    let name = &vm.name;
    match stop {
        Stop::Exited { code, how } => {
            println!(
                "vm {name}: stopped: exit code {code} ({how}) after {} ticks",
                vm.run_ticks.load(Ordering::Relaxed)
            )
        }
        Stop::WithVm => println!("vm {name}: stopped"),
        Stop::Fault(report) => {
            for (i, line) in report.lines().enumerate() {
                if i == 0 {
                    println!("vm {name}: stopped: {line}");
                } else {
                    println!("vm {name}:   {line}");
                }
            }
        }
        Stop::Budget => println!(
            "vm {name}: stopped: run budget of {} ticks exhausted (budget= module argument)",
            vm.budget
        ),
        Stop::WallBudget => println!(
            "vm {name}: stopped: wall budget of {} ticks since its start exhausted after {} ticks of running (wall-budget= module argument)",
            vm.wall_budget,
            vm.run_ticks.load(Ordering::Relaxed)
        ),
        Stop::HaltedForever => println!(
            "vm {name}: stopped: HLT with no event that could wake the vCPU (no virtual timer armed)"
        ),
    }
    if let Some(t) = &vm.target {
        match t.checksum {
            Some(before) => {
                let after = page_checksum(t.hpa);
                println!(
                    "vm {name}: target {} at host {:#x}: page checksum {before:#018x} before, {after:#018x} after: {}",
                    t.what,
                    t.hpa,
                    if before == after {
                        "unchanged"
                    } else {
                        "CHANGED"
                    }
                );
            }
            None => println!(
                "vm {name}: target {} at {:#x} (not RAM: no checksum)",
                t.what, t.hpa
            ),
        }
    }
}

/// The VM's exit statistics (its vCPUs' added up): printed for people, and sent in the VM's end
/// frame with its vCPU 0's IA32_LSTAR and its task offsets, for the analyzer. Done once every
/// VM has stopped: on a slow console the table costs more than the run's last slices, and it
/// would be sampled as theirs.
pub fn exit_stats(vm: &Vm) {
    let mut exits = ExitStats::default();
    for v in &vm.vcpus {
        exits.merge(&v.lock().stats);
    }
    print!("{}", exits.table(&vm.name, exit_name));
    super::vpmu::print_stats(vm);
    // Each vCPU's spin sites, read once for the console and the end frame.
    let spins: alloc::vec::Vec<SpinSites> = if vm.ple == Ple::Off {
        alloc::vec::Vec::new()
    } else {
        vm.vcpus.iter().map(|v| v.lock().spins).collect()
    };
    print_spin_sites(vm, &spins);
    let lstar = vm.vcpus.first().map_or(0, |v| v.lock().msrs[LSTAR_SLOT]);
    profiler::export::send_vm_end(&VmEnd {
        vm: vm.index,
        lstar,
        task_offsets: vm.task_offsets,
        exits,
        pause_loop: pause_loop(vm, &spins),
        vpmu: super::vpmu::end_frame(vm),
        page_table_isolation: vm.isolation.get().copied(),
    });
    if let Some(layout) = &vm.module_layout {
        // The list now, added to those read during the run (at samples in a module not known
        // yet): every module the run saw, each once.
        let (now, whole) = super::linux_tasks::read_modules(vm, layout, lstar);
        let mut maps = vm.maps.lock();
        for m in now {
            maps.modules.add(m);
        }
        let modules = &maps.modules;
        for m in &modules.list {
            profiler::export::send_mapping(m);
        }
        println!(
            "vm {}: {} kernel modules read from guest memory ({} lists read during the run, {} reads refused, {} modules not kept){}",
            vm.name,
            modules.list.len(),
            modules.reads,
            modules.reads_refused,
            modules.dropped,
            if whole {
                ""
            } else {
                " (the list could not be read whole at the end)"
            }
        );
    }
    send_output(vm);
    if vm.mm_layout.is_some() {
        let maps = vm.maps.lock();
        for m in &maps.mappings {
            profiler::export::send_mapping(m);
        }
        println!(
            "vm {}: {} executable mappings of {} processes read from guest memory ({} maps read again for a sample outside them, {} re-reads refused; {} walks cut short, {} processes and {} mappings not kept: tables full)",
            vm.name,
            maps.mappings.len(),
            maps.processes(),
            maps.rereads,
            maps.rereads_refused,
            maps.walks_cut,
            maps.processes_dropped,
            maps.mappings_dropped
        );
    }
}

/// The VM's pause-loop exiting for its end frame: the controls and every vCPU's spin sites
/// (`spins`, by vCPU index).
fn pause_loop(vm: &Vm, spins: &[SpinSites]) -> Option<PauseLoop> {
    if vm.ple == Ple::Off {
        return None;
    }
    let mut p = PauseLoop::new(
        vm.ple == Ple::Directed,
        super::pause_loop::GAP,
        super::pause_loop::WINDOW,
    );
    for (i, s) in spins.iter().enumerate() {
        for (rip, exits) in s.by_count() {
            p.add(SpinSite {
                vcpu: i as u16,
                rip,
                exits,
            });
        }
        p.others = p.others.saturating_add(s.others());
    }
    Some(p)
}

/// Per vCPU of `spins` (by index, with `ple=`): its pause-loop exits and the guest RIPs they
/// were at (`vm NAME: vcpu N: pause-loop exits: COUNT at RIP xCOUNT, ...`); the analyzer takes
/// them from the VM's end frame and names the functions that spun.
fn print_spin_sites(vm: &Vm, spins: &[SpinSites]) {
    for (i, s) in spins.iter().enumerate() {
        let mut line = alloc::format!("vm {}: vcpu {i}: pause-loop exits: {}", vm.name, s.total());
        for (n, (rip, count)) in s.by_count().enumerate() {
            let _ = write!(
                line,
                "{}{rip:#x} x{count}",
                if n == 0 { " at " } else { ", " }
            );
        }
        if s.others() > 0 {
            let _ = write!(line, ", {} at other RIPs", s.others());
        }
        println!("{line}");
    }
}

/// Sends what the VM's programs handed over through the output leaf (`output=`), record by
/// record, and says how much.
fn send_output(vm: &Vm) {
    let Some(store) = &vm.output else {
        return;
    };
    let store = store.lock();
    for (stream, bytes) in store.records() {
        profiler::export::send_output(&Output {
            vm: vm.index,
            stream,
            lost: 0,
            bytes,
        });
    }
    if store.lost() > 0 {
        profiler::export::send_output(&Output {
            vm: vm.index,
            stream: OutputStream::Lost,
            lost: store.lost(),
            bytes: &[],
        });
    }
    let (out, err) = store.kept();
    println!(
        "vm {}: output leaf: {out} bytes of stdout and {err} of stderr kept in the sample log ({} lost: no room)",
        vm.name,
        store.lost()
    );
}

pub fn exit_name(reason: u16) -> &'static str {
    BasicExit::from_number(reason).map_or("UNKNOWN", |b| b.name())
}
