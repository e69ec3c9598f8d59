//! The VM's APIC bus: IPIs and the I/O APIC's interrupt messages carried to the local APICs they
//! name (82093AA §2.3; SDM Vol. 3A §12.6), which take them at their next VM entry
//! (`virtual_interrupts`). Exit handlers and the device models' own events both send through here.

use super::{Vm, VmDevices};
use hvprof_hypervisor::devices::lapic::{Delivery, Destination, Effect, Ipi};

/// What a register write asks for.
pub fn carry_out(vm: &Vm, dev: &mut VmDevices, effect: Effect) {
    match effect {
        Effect::Ipi(ipi) => deliver(vm, dev, &ipi),
        // The I/O APIC's entries of that vector may send again (their remote IRR clears).
        Effect::LevelEoi(vector) => {
            dev.board.ioapic.eoi(vector);
            route_io_apic(vm, dev);
        }
        // The timer's new deadline is taken at the next VM entry.
        Effect::Timer | Effect::None => {}
    }
}

/// Sends the interrupts the I/O APIC has (its pins as the guest programmed them) to the local
/// APICs they name, as an IPI of the same delivery mode would go (82093AA §2.3: the I/O APIC
/// sends interrupt messages on the APIC bus).
pub fn route_io_apic(vm: &Vm, dev: &mut VmDevices) {
    while let Some(m) = dev.board.ioapic.next_message() {
        dev.io_apic_messages += 1;
        let ipi = Ipi {
            delivery: m.delivery,
            vector: m.vector,
            destination: if m.logical {
                Destination::Logical(m.destination)
            } else {
                Destination::Physical(m.destination)
            },
            // No sender: the shorthands (the only users of it) are not in an entry.
            source: 0xff,
            level_triggered: m.level,
            assert: true,
        };
        match m.delivery {
            Delivery::Fixed | Delivery::LowestPriority | Delivery::Nmi => {
                deliver_to_targets(vm, dev, &ipi);
            }
            // ExtINT (the 8259 through the I/O APIC) and the rest: the 8259 reaches vCPU 0
            // through its LINT0 instead.
            other => {
                if crate::vm::first_time(&mut dev.logged_ipis, other) {
                    crate::vm_report!(
                        vm,
                        "I/O APIC pin {} in {other:?} mode not delivered (reported once)",
                        m.pin
                    );
                }
            }
        }
    }
}

/// A fixed, lowest-priority or NMI interrupt (an IPI's or the I/O APIC's) to the vCPUs it
/// names; they take it at their next VM entry. Lowest priority goes to one of them: the first
/// (SDM Vol. 3A §11.6.2.4 lets the choice be the model's; all vCPUs run at TPR 0 under Linux).
fn deliver_to_targets(vm: &Vm, dev: &mut VmDevices, ipi: &Ipi) {
    for (i, l) in dev.lapics.iter_mut().enumerate() {
        if !l.is_target(ipi) {
            continue;
        }
        if ipi.delivery == Delivery::Nmi {
            // SDM Vol. 3A §11.6.1, delivery mode 100B: latched at the target, injected at its
            // next VM entry when it is not blocking NMIs (vm/virtual_interrupts.rs).
            l.accept_nmi();
            dev.nmis += 1;
        } else {
            l.accept(ipi.vector, ipi.level_triggered);
        }
        vm.notify(i);
        if ipi.delivery == Delivery::LowestPriority {
            break;
        }
    }
}

/// An IPI to the vCPUs it names (they take it at their next VM entry).
fn deliver(vm: &Vm, dev: &mut VmDevices, ipi: &Ipi) {
    dev.ipis += 1;
    match ipi.delivery {
        Delivery::Fixed | Delivery::LowestPriority | Delivery::Nmi => {
            deliver_to_targets(vm, dev, ipi);
        }
        // INIT level de-assert is a no-op on every APIC since the Pentium 4.
        Delivery::Init if ipi.is_init_deassert() => {}
        // INIT: the target's APIC goes back to its state after INIT, and the vCPU to
        // wait-for-SIPI (one that runs at its next look, one not started yet is there already).
        Delivery::Init => {
            for (i, l) in dev.lapics.iter_mut().enumerate() {
                if l.is_target(ipi) && i != usize::from(ipi.source) {
                    l.init();
                    vm.send_init(i);
                    dev.inits += 1;
                }
            }
        }
        Delivery::StartUp => {
            for (i, l) in dev.lapics.iter().enumerate() {
                if l.is_target(ipi) && i != usize::from(ipi.source) {
                    vm.send_sipi(i, ipi.vector);
                    dev.sipis += 1;
                }
            }
        }
        other => {
            if crate::vm::first_time(&mut dev.logged_ipis, other) {
                crate::vm_report!(
                    vm,
                    "{other:?} IPI not delivered (not emulated yet; reported once)"
                );
            }
        }
    }
}
