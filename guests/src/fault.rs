//! A caught exception, as the fault-tolerant accessors report it: `hvprof_x86_trap`'s
//! (`shared/x86-trap`), the same the hypervisor uses.

pub use hvprof_x86_trap::{Fault, GP, PF, UD, mnemonic};
