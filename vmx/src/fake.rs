//! A fake current VMCS for host tests (feature `fake-vmcs`, and this crate's own tests): every
//! field of this crate's enums exists and starts at 0; VMREAD/VMWRITE of any other encoding fails
//! with VM-instruction error 12, VMWRITE of a read-only field with error 13 (SDM Vol. 3C §32.3,
//! "VM Instruction Error Numbers"), as a real VMCS does.

extern crate alloc;

use alloc::collections::BTreeMap;
use alloc::vec::Vec;

use crate::errors::{InstructionError, VmFail};
use crate::vmcs::{
    Control16, Control32, Control64, ControlNatural, FieldType, Guest16, Guest32, Guest64,
    GuestNatural, Host16, Host32, Host64, HostNatural, ReadOnly32, ReadOnly64, ReadOnlyNatural,
    VmcsAccess, VmcsField, Width, type_of, width_of,
};

/// Field encoding → value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FakeVmcs(pub BTreeMap<u32, u64>);

impl Default for FakeVmcs {
    fn default() -> Self {
        Self::new()
    }
}

impl FakeVmcs {
    /// Every known field, zero.
    #[must_use]
    pub fn new() -> Self {
        FakeVmcs(all_encodings().into_iter().map(|e| (e, 0)).collect())
    }

    fn unsupported() -> VmFail {
        VmFail::Valid(InstructionError::UnsupportedComponent)
    }
}

/// Every field encoding of this crate's enums.
#[must_use]
pub fn all_encodings() -> Vec<u32> {
    fn add<F: VmcsField>(out: &mut Vec<u32>, all: &[F]) {
        out.extend(all.iter().map(|f| f.encoding()));
    }
    let mut v = Vec::new();
    add(&mut v, Control16::ALL);
    add(&mut v, Guest16::ALL);
    add(&mut v, Host16::ALL);
    add(&mut v, Control64::ALL);
    add(&mut v, ReadOnly64::ALL);
    add(&mut v, Guest64::ALL);
    add(&mut v, Host64::ALL);
    add(&mut v, Control32::ALL);
    add(&mut v, ReadOnly32::ALL);
    add(&mut v, Guest32::ALL);
    add(&mut v, Host32::ALL);
    add(&mut v, ControlNatural::ALL);
    add(&mut v, ReadOnlyNatural::ALL);
    add(&mut v, GuestNatural::ALL);
    add(&mut v, HostNatural::ALL);
    v
}

impl VmcsAccess for FakeVmcs {
    fn read(&self, encoding: u32) -> Result<u64, VmFail> {
        let v = *self.0.get(&encoding).ok_or_else(Self::unsupported)?;
        Ok(match width_of(encoding) {
            Width::Bits16 => v & 0xffff,
            Width::Bits32 => v & 0xffff_ffff,
            Width::Bits64 | Width::Natural => v,
        })
    }

    fn write(&mut self, encoding: u32, value: u64) -> Result<(), VmFail> {
        let slot = self.0.get_mut(&encoding).ok_or_else(Self::unsupported)?;
        if type_of(encoding) == FieldType::ReadOnly {
            return Err(VmFail::Valid(InstructionError::WriteReadOnlyComponent));
        }
        *slot = value;
        Ok(())
    }
}
