//! Hypercalls (guest ABI "Hypercalls"): `vmcall` with the function in RAX, arguments in RDI and
//! RSI, the result in RAX.

/// Returns the ABI version (1).
pub const VERSION: u64 = 0;
/// Prints RSI bytes at guest-physical RDI (at most 4096).
pub const PRINT: u64 = 1;
/// Stops the VM with exit code RDI (low 8 bits).
pub const EXIT: u64 = 2;
/// Wake the vCPU from its next HLT this many TSC ticks from now (0 disarms).
pub const SET_TIMER: u64 = 3;

/// What an unknown function returns.
pub const ERR_UNKNOWN: u64 = u64::MAX - 1;
/// What PRINT returns for a buffer outside guest memory.
pub const ERR_BAD_BUFFER: u64 = u64::MAX;

/// One raw hypercall.
///
/// Memory-safe whatever the arguments: the hypervisor only ever reads guest memory (PRINT), and
/// outside a hypervisor `vmcall` raises #UD, which the runtime reports as an unexpected exception.
pub fn hypercall(function: u64, arg0: u64, arg1: u64) -> u64 {
    let result: u64;
    // SAFETY: see above; the asm may read memory (PRINT), so no `nomem`/`readonly`.
    unsafe {
        core::arch::asm!("vmcall", inout("rax") function => result, in("rdi") arg0,
            in("rsi") arg1, options(nostack));
    }
    result
}

/// VERSION: the guest ABI version the hypervisor implements.
/// Arms the virtual timer: the next HLT returns `ticks` TSC ticks from now.
pub fn set_timer(ticks: u64) -> u64 {
    hypercall(SET_TIMER, ticks, 0)
}

pub fn version() -> u64 {
    hypercall(VERSION, 0, 0)
}

/// PRINT: hands `bytes` to the hypervisor console (the guest is identity-mapped, so the pointer
/// is the guest-physical address). Returns 0, or [`ERR_BAD_BUFFER`].
pub fn print(bytes: &[u8]) -> u64 {
    hypercall(PRINT, bytes.as_ptr() as u64, bytes.len() as u64)
}

/// EXIT: stops the VM with `code`.
pub fn exit(code: u8) -> ! {
    hypercall(EXIT, code as u64, 0);
    // Not reached under hvprof; stop here if it comes back anyway.
    crate::rt::exit(code)
}
