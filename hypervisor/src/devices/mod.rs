//! Device models a VM sees (docs/GUEST-ABI.md, "Devices"), each pure logic driven by port
//! accesses and the host TSC, tested on the host.
/// The ACPI PM1a event and control blocks (ports 0x600-0x605; `apic=on`).
pub mod acpi_pm;
/// The legacy PC as a whole: port decoding and the interrupt lines.
pub mod board;
/// The MC146818 clock and CMOS RAM (0x70-0x71).
pub mod cmos;
/// QEMU's firmware configuration ports (0x510-0x511): the machine's CPUs and RAM.
pub mod fw_cfg;
/// The I/O APIC (0xfec00000; `apic=on`): the legacy devices' interrupts to any vCPU.
pub mod ioapic;
/// A vCPU's local APIC (xAPIC registers at 0xfee00000, timer, IPIs).
pub mod lapic;
/// The two cascaded 8259A interrupt controllers (0x20-0x21, 0xa0-0xa1).
pub mod pic;
/// The 8254 interval timer (0x40-0x43) and port 0x61.
pub mod pit;
/// QEMU's pc-testdev (0xe0-0xe7, 0x2000-0x2017; `testdev=on`): kvm-unit-tests' test device.
pub mod testdev;
/// COM1's 16550A (0x3f8-0x3ff).
pub mod uart;
