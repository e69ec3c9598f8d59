//! The ACPI tables a Linux guest finds its vCPUs and interrupt controllers in: RSDP, XSDT, FADT
//! (with FACS and a DSDT that holds only `\_S5`), MADT (a local APIC per vCPU, optionally the
//! I/O APIC, the PC's interrupt source overrides, LINT1 as NMI). Built by the hypervisor in one
//! page of guest memory in the BIOS area (reserved in the guest's e820 map), found through
//! `boot_params`' `acpi_rsdp_addr` or the usual scan of 0xe0000-0xfffff.
//!
//! The hypervisor describes the I/O APIC (`devices::ioapic`); without one in the MADT, Linux
//! runs in "virtual wire" mode: the 8259's interrupts reach the boot vCPU through its LINT0
//! (ExtINT), and the other vCPUs still start.
//!
//! Debian's kernel ignores MP tables (`CONFIG_X86_MPPARSE` off): its CPUs come from the MADT.
//!
//! ACPI 6.5: "Root System Description Pointer (RSDP) Structure" (§5.2.5.3), "Extended System
//! Description Table" (§5.2.8), "Fixed ACPI Description Table" (§5.2.9, Table 5.9; IA-PC boot
//! architecture flags Table 5.11; fixed feature flags Table 5.10), "Firmware ACPI Control
//! Structure" (§5.2.10), "Multiple APIC Description Table" (§5.2.12: Processor Local APIC,
//! I/O APIC, Interrupt Source Override, Local APIC NMI structures), "Generic Address Structure"
//! (§5.2.3.2), "\_Sx (System States)" (§7.4.2) and the AML encoding of `Name` and `Package`
//! (§20.2.5.1, §20.2.5.4).

/// Where the tables go: the BIOS area's last 64 KiB, which Linux scans for an RSDP and the
/// guest's e820 map reserves (`linux_boot::e820`).
pub const ACPI_GPA: u64 = 0xf_0000;
/// The page the tables fill (at most).
pub const ACPI_SIZE: usize = 0x1000;
/// The I/O APIC's registers.
pub const IOAPIC_BASE: u64 = 0xfec0_0000;
/// The local APIC's registers (every vCPU's, at the same address).
pub const LAPIC_BASE: u64 = 0xfee0_0000;
/// The PM1a event block (status, enable: 2 bytes each) and control block (2 bytes), I/O ports.
pub const PM1A_EVT: u16 = 0x600;
pub const PM1A_CNT: u16 = 0x604;
/// The PM timer (a 24-bit count at 3.579545 MHz, read as 32 bits), I/O port.
pub const PM_TMR: u16 = 0x608;
/// The SLP_TYP value of S5 (soft off) in `\_S5`: a write of it with SLP_EN to PM1a_CNT powers
/// the VM off.
pub const SLP_TYP_S5: u8 = 5;
/// The SCI's IRQ (level-triggered, active high, as on PCs).
pub const SCI_IRQ: u8 = 9;
/// The most vCPUs the page holds room for.
pub const MAX_VCPUS: usize = 64;

const OEM_ID: &[u8; 6] = b"HVPROF";
const OEM_TABLE_ID: &[u8; 8] = b"HVPROF  ";

/// Table offsets inside the page.
const RSDP_AT: usize = 0;
const XSDT_AT: usize = 0x40;
const FACS_AT: usize = 0x80;
const FADT_AT: usize = 0xc0;
const DSDT_AT: usize = 0x200;
const MADT_AT: usize = 0x240;

/// `\_S5 = Package() { 5, 5 }`: NameOp, "_S5_", PackageOp, PkgLength 6, 2 elements, BytePrefix
/// 5 twice.
const DSDT_AML: [u8; 12] = [
    0x08, b'_', b'S', b'5', b'_', 0x12, 0x06, 0x02, 0x0a, SLP_TYP_S5, 0x0a, SLP_TYP_S5,
];

/// Why no tables were built.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Error {
    /// No vCPU, or more than `MAX_VCPUS`.
    VcpuCount(usize),
}

impl core::fmt::Display for Error {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Error::VcpuCount(n) => write!(f, "{n} vCPUs: the ACPI tables take 1 to {MAX_VCPUS}"),
        }
    }
}

fn put(out: &mut [u8], at: usize, bytes: &[u8]) {
    out[at..at + bytes.len()].copy_from_slice(bytes);
}

fn checksum(bytes: &[u8]) -> u8 {
    0u8.wrapping_sub(bytes.iter().fold(0u8, |a, b| a.wrapping_add(*b)))
}

/// A System Description Table header at `at`, for a table of `len` bytes; the checksum is
/// filled in by `seal`.
fn header(out: &mut [u8], at: usize, signature: &[u8; 4], len: usize, revision: u8) {
    put(out, at, signature);
    put(out, at + 4, &(len as u32).to_le_bytes());
    out[at + 8] = revision;
    put(out, at + 10, OEM_ID);
    put(out, at + 16, OEM_TABLE_ID);
    put(out, at + 24, &1u32.to_le_bytes());
    put(out, at + 28, b"HVPF");
    put(out, at + 32, &1u32.to_le_bytes());
}

/// Sets the checksum (byte 9) of the table at `at` of `len` bytes.
fn seal(out: &mut [u8], at: usize, len: usize) {
    out[at + 9] = 0;
    out[at + 9] = checksum(&out[at..at + len]);
}

/// A Generic Address Structure for `width` bits of I/O space at `port`.
fn io_gas(port: u16, width: u8) -> [u8; 12] {
    let mut g = [0u8; 12];
    g[0] = 1; // System I/O
    g[1] = width;
    g[3] = match width {
        8 => 1,
        16 => 2,
        _ => 3,
    };
    g[4..6].copy_from_slice(&port.to_le_bytes());
    g
}

/// Builds the tables for vCPUs with these APIC IDs (the first is the boot vCPU), with an I/O
/// APIC or not, with the PM timer or not, into `out`, which is guest memory at `base_gpa`.
/// Returns the RSDP's guest-physical address.
pub fn build(
    apic_ids: &[u8],
    io_apic: bool,
    pm_timer: bool,
    base_gpa: u64,
    out: &mut [u8; ACPI_SIZE],
) -> Result<u64, Error> {
    let n = apic_ids.len();
    if n == 0 || n > MAX_VCPUS {
        return Err(Error::VcpuCount(n));
    }
    out.fill(0);
    let gpa = |at: usize| base_gpa + at as u64;

    // MADT.
    let madt_len = 44 + 8 * n + if io_apic { 12 } else { 0 } + 10 + 10 + 6;
    header(out, MADT_AT, b"APIC", madt_len, 5);
    put(out, MADT_AT + 36, &(LAPIC_BASE as u32).to_le_bytes());
    put(out, MADT_AT + 40, &1u32.to_le_bytes()); // PCAT_COMPAT: the 8259 pair is there
    let mut at = MADT_AT + 44;
    for (uid, &id) in apic_ids.iter().enumerate() {
        // Processor Local APIC: UID, APIC ID, enabled.
        put(out, at, &[0, 8, uid as u8, id, 1, 0, 0, 0]);
        at += 8;
    }
    if io_apic {
        // The I/O APIC, its ID after the vCPUs', GSIs from 0.
        let ioapic_id = apic_ids.iter().max().map_or(0, |m| m.wrapping_add(1));
        put(out, at, &[1, 12, ioapic_id, 0]);
        put(out, at + 4, &(IOAPIC_BASE as u32).to_le_bytes());
        at += 12;
    }
    // The PIT's IRQ 0 on GSI 2 (as on PCs), conforming polarity and trigger.
    put(out, at, &[2, 10, 0, 0]);
    put(out, at + 4, &2u32.to_le_bytes());
    at += 10;
    // The SCI on GSI 9, level-triggered, active high (MPS INTI flags 0b11_01).
    put(out, at, &[2, 10, 0, SCI_IRQ]);
    put(out, at + 4, &u32::from(SCI_IRQ).to_le_bytes());
    put(out, at + 8, &0x000du16.to_le_bytes());
    at += 10;
    // LINT1 is NMI on every processor (UID 0xff).
    put(out, at, &[4, 6, 0xff, 0, 0, 1]);
    debug_assert_eq!(at + 6, MADT_AT + madt_len);
    seal(out, MADT_AT, madt_len);

    // DSDT: only `\_S5`.
    let dsdt_len = 36 + DSDT_AML.len();
    header(out, DSDT_AT, b"DSDT", dsdt_len, 2);
    put(out, DSDT_AT + 36, &DSDT_AML);
    seal(out, DSDT_AT, dsdt_len);

    // FACS (no checksum; 64-byte aligned).
    put(out, FACS_AT, b"FACS");
    put(out, FACS_AT + 4, &64u32.to_le_bytes());
    out[FACS_AT + 32] = 2; // version

    // FADT, revision 6 (ACPI 6.5 Table 5.9).
    let fadt_len = 276;
    let f = FADT_AT;
    header(out, f, b"FACP", fadt_len, 6);
    put(out, f + 36, &(gpa(FACS_AT) as u32).to_le_bytes());
    put(out, f + 40, &(gpa(DSDT_AT) as u32).to_le_bytes());
    put(out, f + 46, &u16::from(SCI_IRQ).to_le_bytes());
    // SMI_CMD 0: the platform is in ACPI mode already.
    put(out, f + 56, &u32::from(PM1A_EVT).to_le_bytes());
    put(out, f + 64, &u32::from(PM1A_CNT).to_le_bytes());
    if pm_timer {
        put(out, f + 76, &u32::from(PM_TMR).to_le_bytes());
        out[f + 91] = 4; // PM_TMR_LEN
        put(out, f + 208, &io_gas(PM_TMR, 32));
    }
    out[f + 88] = 4; // PM1_EVT_LEN
    out[f + 89] = 2; // PM1_CNT_LEN
    // IA-PC boot architecture: no 8042 (bit 1 clear), VGA not present (bit 2); the CMOS clock
    // is there (bit 5 clear).
    put(out, f + 109, &(1u16 << 2).to_le_bytes());
    // Fixed features: WBINVD (0), C1 on all processors (2), no fixed power (4) or sleep (5)
    // button.
    put(
        out,
        f + 112,
        &((1u32 << 0) | (1 << 2) | (1 << 4) | (1 << 5)).to_le_bytes(),
    );
    out[f + 131] = 5; // FADT minor version
    put(out, f + 132, &gpa(FACS_AT).to_le_bytes());
    put(out, f + 140, &gpa(DSDT_AT).to_le_bytes());
    put(out, f + 148, &io_gas(PM1A_EVT, 32));
    put(out, f + 172, &io_gas(PM1A_CNT, 16));
    put(out, f + 268, b"HVPROF\0\0");
    seal(out, f, fadt_len);

    // XSDT: the FADT and the MADT.
    let xsdt_len = 36 + 16;
    header(out, XSDT_AT, b"XSDT", xsdt_len, 1);
    put(out, XSDT_AT + 36, &gpa(FADT_AT).to_le_bytes());
    put(out, XSDT_AT + 44, &gpa(MADT_AT).to_le_bytes());
    seal(out, XSDT_AT, xsdt_len);

    // RSDP, revision 2 (ACPI 2.0+): no RSDT (its address 0), the XSDT.
    put(out, RSDP_AT, b"RSD PTR ");
    put(out, RSDP_AT + 9, OEM_ID);
    out[RSDP_AT + 15] = 2;
    put(out, RSDP_AT + 20, &36u32.to_le_bytes());
    put(out, RSDP_AT + 24, &gpa(XSDT_AT).to_le_bytes());
    out[RSDP_AT + 8] = checksum(&out[RSDP_AT..RSDP_AT + 20]);
    out[RSDP_AT + 32] = checksum(&out[RSDP_AT..RSDP_AT + 36]);
    Ok(gpa(RSDP_AT))
}

#[cfg(test)]
mod tests {
    use super::*;
    use acpi::fadt::Fadt;
    use acpi::madt::{Madt, MadtEntry};
    use acpi::{AcpiHandler, AcpiTables, PhysicalMapping};
    use core::ptr::NonNull;

    /// The page as guest memory at `ACPI_GPA`.
    #[derive(Clone, Copy)]
    struct Page(*const u8);

    impl AcpiHandler for Page {
        unsafe fn map_physical_region<T>(
            &self,
            at: usize,
            size: usize,
        ) -> PhysicalMapping<Self, T> {
            let off = at - ACPI_GPA as usize;
            assert!(
                off + size <= ACPI_SIZE,
                "read outside the page: {at:#x}+{size}"
            );
            // SAFETY: the range lies in the test's page (checked), which outlives the tables.
            unsafe {
                PhysicalMapping::new(
                    at,
                    NonNull::new_unchecked(self.0.add(off) as *mut T),
                    size,
                    size,
                    *self,
                )
            }
        }
        fn unmap_physical_region<T>(_: &PhysicalMapping<Self, T>) {}
    }

    #[test]
    fn the_acpi_crate_reads_the_vcpus_and_the_power_off_registers() {
        let mut page = Box::new([0u8; ACPI_SIZE]);
        let rsdp = build(&[0, 1], true, true, ACPI_GPA, &mut page).unwrap();
        assert_eq!(rsdp, ACPI_GPA);
        let h = Page(page.as_ptr());
        // SAFETY: `rsdp` is the RSDP just built; the handler maps only the page.
        let tables = unsafe { AcpiTables::from_rsdp(h, rsdp as usize) }.unwrap();
        let madt = tables.find_table::<Madt>().unwrap();
        assert_eq!({ madt.get().local_apic_address }, LAPIC_BASE as u32);
        let mut cpus = Vec::new();
        let mut ioapics = Vec::new();
        let mut overrides = Vec::new();
        let mut nmis = 0;
        for e in madt.get().entries() {
            match e {
                MadtEntry::LocalApic(l) => cpus.push((l.processor_id, l.apic_id, { l.flags })),
                MadtEntry::IoApic(io) => ioapics.push((io.io_apic_id, { io.io_apic_address })),
                MadtEntry::InterruptSourceOverride(o) => {
                    overrides.push((o.irq, { o.global_system_interrupt }, { o.flags }))
                }
                MadtEntry::LocalApicNmi(n) => {
                    nmis += 1;
                    assert_eq!((n.processor_id, n.nmi_line), (0xff, 1));
                }
                other => panic!("unexpected entry {other:?}"),
            }
        }
        assert_eq!(cpus, [(0, 0, 1), (1, 1, 1)]);
        assert_eq!(ioapics, [(2, IOAPIC_BASE as u32)]);
        assert_eq!(overrides, [(0, 2, 0), (SCI_IRQ, 9, 0xd)]);
        assert_eq!(nmis, 1);
        let fadt = tables.find_table::<Fadt>().unwrap();
        assert_eq!(
            fadt.pm1a_control_block().unwrap().address,
            u64::from(PM1A_CNT)
        );
        assert_eq!(
            fadt.pm_timer_block().unwrap().map(|b| b.address),
            Some(u64::from(PM_TMR))
        );
        // Without the PM timer (a Linux guest's tables): neither its block nor its length.
        let mut plain = [0u8; ACPI_SIZE];
        build(&[0, 1], true, false, ACPI_GPA, &mut plain).unwrap();
        let f = FADT_AT;
        assert_eq!(&plain[f + 76..f + 80], &[0; 4]);
        assert_eq!(plain[f + 91], 0);
        assert_eq!(&plain[f + 208..f + 220], &[0; 12]);
        assert_eq!(
            fadt.pm1a_event_block().unwrap().address,
            u64::from(PM1A_EVT)
        );
        let dsdt = tables.dsdt().unwrap();
        let off = dsdt.address - ACPI_GPA as usize;
        let aml = &page[off..off + dsdt.length as usize];
        assert_eq!(
            hvprof_boot::acpi::find_s5(aml),
            Some((SLP_TYP_S5, SLP_TYP_S5))
        );
    }

    #[test]
    fn every_checksum_holds_and_sizes_are_bounded() {
        for n in [1, 2, 8, MAX_VCPUS] {
            let ids: Vec<u8> = (0..n as u8).collect();
            let mut page = Box::new([0u8; ACPI_SIZE]);
            build(&ids, n % 2 == 0, n % 3 == 0, 0x1000, &mut page).unwrap();
            let sum = |b: &[u8]| b.iter().fold(0u8, |a, x| a.wrapping_add(*x));
            assert_eq!(sum(&page[..20]), 0);
            assert_eq!(sum(&page[..36]), 0);
            for at in [XSDT_AT, FADT_AT, DSDT_AT, MADT_AT] {
                let len = u32::from_le_bytes(page[at + 4..at + 8].try_into().unwrap()) as usize;
                assert!(at + len <= ACPI_SIZE, "{n} vCPUs: table at {at:#x}");
                assert_eq!(sum(&page[at..at + len]), 0, "{n} vCPUs: table at {at:#x}");
            }
        }
        let mut page = Box::new([0u8; ACPI_SIZE]);
        assert_eq!(
            build(&[], true, true, 0, &mut page),
            Err(Error::VcpuCount(0))
        );
        assert_eq!(
            build(&[0; MAX_VCPUS + 1], true, true, 0, &mut page),
            Err(Error::VcpuCount(MAX_VCPUS + 1))
        );
    }
}
