//! Device models a VM sees (docs/GUEST-ABI.md, "Devices").
pub mod uart;
