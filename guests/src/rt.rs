//! Entry, exit and panic.

use crate::io::outb;

/// The exit port: an 8-bit write stops the VM with that exit code.
pub const EXIT_PORT: u16 = 0xf4;

/// The ELF entry point. The hypervisor sets RSP (= top of guest memory, 16-byte aligned), RDI
/// (argument string) and RSI (its length); `call` keeps the SysV alignment rule (RSP + 8 16-byte
/// aligned at function entry) and passes RDI/RSI on as the first two arguments. Nothing is zeroed:
/// the loader already zeroed .bss.
#[unsafe(naked)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn _start() -> ! {
    core::arch::naked_asm!(
        "xor ebp, ebp",
        "call {start}",
        "ud2",
        start = sym rust_start,
    )
}

unsafe extern "Rust" {
    /// Defined by the binary through `guest_entry!`.
    fn __hvprof_guest_main(args: &'static str) -> u8;
}

/// The longest argument string read: the argument page is 4 KiB with a terminating NUL.
const ARGS_MAX: usize = 4095;

extern "C" fn rust_start(args: *const u8, len: usize) -> ! {
    crate::idt::init();
    let args: &'static str = if args.is_null() || len == 0 {
        ""
    } else {
        // SAFETY: the hypervisor passes the argument page (GPA 0x2000, identity-mapped, never
        // written by the guest) and the string's length, capped to the page here.
        let bytes = unsafe { core::slice::from_raw_parts(args, len.min(ARGS_MAX)) };
        match core::str::from_utf8(bytes) {
            Ok(s) => s,
            // Keep the valid prefix; that slice is valid UTF-8 by construction.
            Err(e) => core::str::from_utf8(&bytes[..e.valid_up_to()]).unwrap_or(""),
        }
    };
    // SAFETY: `guest_entry!` defines the symbol with exactly this signature.
    let code = unsafe { __hvprof_guest_main(args) };
    exit(code)
}

/// Stops the VM with `code` through the exit port (then halts, should it come back).
pub fn exit(code: u8) -> ! {
    // SAFETY: writing the exit port stops this VM; nothing is left to run.
    unsafe { outb(EXIT_PORT, code) };
    loop {
        crate::cpu::hlt();
    }
}

#[cfg(not(test))]
#[panic_handler]
fn panic(info: &core::panic::PanicInfo<'_>) -> ! {
    crate::println!("guest panic: {info}");
    exit(crate::exit_code::PANIC)
}
