//! EPT-violation exit qualification (SDM Vol. 3C §28.2.1, Table 28-7 "Exit Qualification for
//! EPT Violations").

use core::fmt;

use bitflags::bitflags;

use crate::entry::Permissions;

bitflags! {
    /// The kind of access that caused the violation: Table 28-7 bits 2:0. A read-modify-write
    /// access may set both `READ` and `WRITE`.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    pub struct Access: u8 {
        /// Bit 0: data read.
        const READ = 1 << 0;
        /// Bit 1: data write.
        const WRITE = 1 << 1;
        /// Bit 2: instruction fetch.
        const FETCH = 1 << 2;
    }
}

/// An EPT violation (exit reason 48): the exit qualification and the guest-physical address,
/// which the CPU stores in the separate VMCS field "guest-physical address" (SDM Vol. 3C
/// §28.2.1). The guest-linear address, when valid, is in its own VMCS field too.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EptViolation {
    pub qualification: u64,
    pub gpa: u64,
}

impl EptViolation {
    pub const fn new(qualification: u64, gpa: u64) -> Self {
        Self { qualification, gpa }
    }
    const fn bit(&self, n: u32) -> bool {
        self.qualification & (1 << n) != 0
    }
    /// Bits 2:0.
    pub fn access(&self) -> Access {
        Access::from_bits_truncate(self.qualification as u8)
    }
    /// Bits 5:3: the AND of bits 0, 1 and 2 of the EPT entries of the walk, i.e. what the
    /// translation allows (bit 5 is supervisor-mode execute under mode-based execute control).
    /// Empty when the walk met a not-present entry.
    pub fn allowed(&self) -> Permissions {
        Permissions::from_bits_truncate(((self.qualification >> 3) & 0b111) as u8)
    }
    /// Bit 7: the VMCS guest-linear-address field is valid.
    pub const fn linear_address_valid(&self) -> bool {
        self.bit(7)
    }
    /// Bit 8, defined only if bit 7 is set: `Some(true)` if the access was to the translation
    /// of a linear address, `Some(false)` if it was to a guest paging-structure entry (a guest
    /// page walk or its A/D update).
    pub const fn is_linear_translation(&self) -> Option<bool> {
        if self.linear_address_valid() {
            Some(self.bit(8))
        } else {
            None
        }
    }
    /// Bit 12: the access was by an IRET that unblocked NMIs; the VMM must block NMIs again
    /// ("blocking by NMI" in the guest interruptibility state) before resuming the guest if it
    /// re-executes the IRET (SDM Vol. 3C §28.2.3).
    pub const fn nmi_unblocking(&self) -> bool {
        self.bit(12)
    }
}

/// `write to GPA 0x1234 (page is read/execute)`, `not present` instead of the rights when the
/// walk met a not-present entry, and `, guest page walk` when the access was to a guest
/// paging-structure entry.
impl fmt::Display for EptViolation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let a = self.access();
        let mut first = true;
        for (flag, name) in [
            (Access::READ, "read"),
            (Access::WRITE, "write"),
            (Access::FETCH, "fetch"),
        ] {
            if a.contains(flag) {
                f.write_str(if first { "" } else { "/" })?;
                f.write_str(name)?;
                first = false;
            }
        }
        if first {
            f.write_str("access")?;
        }
        write!(f, " to GPA {:#x} (page is ", self.gpa)?;
        let p = self.allowed();
        if p.is_empty() {
            f.write_str("not present")?;
        } else {
            write!(f, "{p}")?;
        }
        f.write_str(")")?;
        if self.is_linear_translation() == Some(false) {
            f.write_str(", guest page walk")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_to_read_execute_page() {
        // Write (bit 1), page readable + executable (bits 3, 5), GLA valid and a translation
        // (bits 7, 8): 0b1_1010_1010.
        let v = EptViolation::new(0x1aa, 0x1234);
        assert_eq!(v.access(), Access::WRITE);
        assert_eq!(v.allowed(), Permissions::RX);
        assert!(v.linear_address_valid());
        assert_eq!(v.is_linear_translation(), Some(true));
        assert!(!v.nmi_unblocking());
        assert_eq!(v.to_string(), "write to GPA 0x1234 (page is read/execute)");
    }

    #[test]
    fn fetch_from_unmapped_page() {
        // Instruction fetch, nothing allowed, GLA valid.
        let v = EptViolation::new(0x184, 0xfee0_0000);
        assert_eq!(v.access(), Access::FETCH);
        assert!(v.allowed().is_empty());
        assert_eq!(
            v.to_string(),
            "fetch to GPA 0xfee00000 (page is not present)"
        );
    }

    #[test]
    fn guest_page_walk_and_nmi_unblocking() {
        // Read+write (A/D update of a guest PTE), page read-only, GLA valid, bit 8 clear,
        // NMI unblocking (bit 12).
        let v = EptViolation::new(0x1000 | 0x80 | 0x08 | 0x3, 0x7000);
        assert_eq!(v.access(), Access::READ | Access::WRITE);
        assert_eq!(v.allowed(), Permissions::READ);
        assert_eq!(v.is_linear_translation(), Some(false));
        assert!(v.nmi_unblocking());
        assert_eq!(
            v.to_string(),
            "read/write to GPA 0x7000 (page is read), guest page walk"
        );
    }

    #[test]
    fn no_linear_address() {
        // Bit 8 is undefined without bit 7 and must not be reported.
        let v = EptViolation::new(0x101, 0x10_0000);
        assert!(!v.linear_address_valid());
        assert_eq!(v.is_linear_translation(), None);
        assert_eq!(v.to_string(), "read to GPA 0x100000 (page is not present)");
    }
}
