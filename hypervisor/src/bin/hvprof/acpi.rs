//! ACPI through the `acpi` crate: the MADT's CPUs and the FADT's power-off registers.
//!
//! The hypervisor identity-maps the first 4 GiB (boot/entry.rs), where firmware puts its ACPI
//! tables; a table outside that window is reported, not touched.

use acpi::fadt::Fadt;
use acpi::madt::{Madt, MadtEntry};
use acpi::{AcpiHandler, AcpiTable, AcpiTables, PhysicalMapping};
use core::ptr::NonNull;

/// The identity-mapped window.
const MAPPED_LIMIT: usize = 4 << 30;

#[derive(Clone, Copy, Debug)]
pub struct IdentityMapped;

impl AcpiHandler for IdentityMapped {
    unsafe fn map_physical_region<T>(
        &self,
        physical: usize,
        size: usize,
    ) -> PhysicalMapping<Self, T> {
        // The crate takes the mapping on trust: refuse (by panicking, which reports and powers
        // off) what lies outside the identity map instead of faulting somewhere inside it.
        assert!(
            physical
                .checked_add(size)
                .is_some_and(|end| end <= MAPPED_LIMIT)
                && physical != 0,
            "ACPI table at {physical:#x} (+{size:#x}) lies outside the identity-mapped 4 GiB"
        );
        // SAFETY: physical memory below 4 GiB is identity-mapped, so the physical address is
        // the virtual one; it is non-null (checked above). The crate reads it as firmware left it.
        unsafe {
            PhysicalMapping::new(
                physical,
                NonNull::new_unchecked(physical as *mut T),
                size,
                size,
                *self,
            )
        }
    }

    fn unmap_physical_region<T>(_region: &PhysicalMapping<Self, T>) {}
}

/// What the hypervisor needs from ACPI.
#[derive(Clone, Copy, Debug)]
pub struct Platform {
    pub oem_id: [u8; 6],
    /// APIC IDs of the enabled (or online-capable) CPUs, boot CPU first.
    pub cpus: [u32; MAX_CPUS],
    pub cpu_count: usize,
    /// MADT entries beyond `MAX_CPUS` (reported, not used).
    pub cpus_ignored: usize,
    pub local_apic_address: u64,
    pub power_off: Option<PowerOff>,
}

pub const MAX_CPUS: usize = 64;

/// ACPI S5 through the PM1 control registers (ACPI 6.5 §4.8.3.2 and §7.4.2).
#[derive(Clone, Copy, Debug)]
pub struct PowerOff {
    pub pm1a_control: u16,
    pub pm1b_control: Option<u16>,
    pub slp_typ_a: u8,
    pub slp_typ_b: u8,
}

#[derive(Debug)]
pub enum Error {
    Tables(acpi::AcpiError),
    NoMadt(acpi::AcpiError),
}

impl core::fmt::Display for Error {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Error::Tables(e) => write!(f, "ACPI tables unusable: {e:?}"),
            Error::NoMadt(e) => write!(f, "no usable MADT: {e:?}"),
        }
    }
}

/// Reads the tables from the RSDP at `rsdp` (the copy in the boot information is fine).
pub fn init(rsdp: usize) -> Result<Platform, Error> {
    // SAFETY: `rsdp` points at an RSDP whose signature and checksums the boot-info parser
    // verified; the handler maps only identity-mapped memory.
    let tables = unsafe { AcpiTables::from_rsdp(IdentityMapped, rsdp) }.map_err(Error::Tables)?;
    let mut p = Platform {
        oem_id: [0; 6],
        cpus: [0; MAX_CPUS],
        cpu_count: 0,
        cpus_ignored: 0,
        local_apic_address: 0,
        power_off: None,
    };
    if let Ok(fadt) = tables.find_table::<Fadt>() {
        p.oem_id = fadt.header().oem_id;
        p.power_off = power_off_registers(&tables, &fadt);
    }
    let madt = tables.find_table::<Madt>().map_err(Error::NoMadt)?;
    p.local_apic_address = madt.get().local_apic_address as u64;
    for entry in madt.get().entries() {
        let (apic_id, flags) = match entry {
            MadtEntry::LocalApic(e) => (e.apic_id as u32, e.flags),
            MadtEntry::LocalX2Apic(e) => (e.x2apic_id, e.flags),
            MadtEntry::LocalApicAddressOverride(e) => {
                p.local_apic_address = e.local_apic_address;
                continue;
            }
            _ => continue,
        };
        // Bit 0: enabled; bit 1: online capable (ACPI 6.5 Table 5.37).
        if flags & 0b11 == 0 {
            continue;
        }
        if p.cpu_count == MAX_CPUS {
            p.cpus_ignored += 1;
        } else {
            p.cpus[p.cpu_count] = apic_id;
            p.cpu_count += 1;
        }
    }
    Ok(p)
}

fn power_off_registers(tables: &AcpiTables<IdentityMapped>, fadt: &Fadt) -> Option<PowerOff> {
    let io_port = |a: acpi::address::GenericAddress| -> Option<u16> {
        (a.address_space == acpi::address::AddressSpace::SystemIo && a.address != 0)
            .then(|| u16::try_from(a.address).ok())
            .flatten()
    };
    let pm1a_control = io_port(fadt.pm1a_control_block().ok()?)?;
    let pm1b_control = fadt.pm1b_control_block().ok().flatten().and_then(io_port);
    let dsdt = tables.dsdt().ok()?;
    if dsdt.address.checked_add(dsdt.length as usize)? > MAPPED_LIMIT {
        return None;
    }
    // SAFETY: the DSDT lies in identity-mapped memory (checked above); its length comes from
    // its own header, which the crate validated.
    let aml =
        unsafe { core::slice::from_raw_parts(dsdt.address as *const u8, dsdt.length as usize) };
    let (slp_typ_a, slp_typ_b) = hvprof_boot::acpi::find_s5(aml)?;
    Some(PowerOff {
        pm1a_control,
        pm1b_control,
        slp_typ_a,
        slp_typ_b,
    })
}
