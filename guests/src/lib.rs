//! The runtime of hvprof's test guests: the guest side of guest ABI v1 (`docs/GUEST-ABI.md`).
//!
//! A guest binary is `#![no_std]`/`#![no_main]`, defines `fn main(args: &str) -> u8` and names
//! it with [`guest_entry!`]. The runtime's `_start` keeps the stack the hypervisor set up, installs
//! an IDT (the guest starts without one), calls that function with the module arguments, and
//! leaves through the exit port 0xf4 with the returned code.
//!
//! Exit codes of the runtime itself are in [`exit_code`].
//!
//! The pure parts ([`args`], [`fault`], [`paging`]'s index arithmetic) build everywhere and are
//! unit-tested on the host; everything touching the machine is `#[cfg(target_os = "none")]`.
#![cfg_attr(not(test), no_std)]

pub mod args;
pub mod fault;
pub mod paging;

#[cfg(target_os = "none")]
pub mod cpu;
#[cfg(target_os = "none")]
pub mod hypercall;
#[cfg(target_os = "none")]
pub mod idt;
#[cfg(target_os = "none")]
pub mod io;
#[cfg(target_os = "none")]
mod rt;
#[cfg(target_os = "none")]
pub mod serial;

pub use args::{arg, arg_num};

/// Defines `pub extern "C" fn $name(iterations: u64)`: `iterations` rounds of a two-instruction
/// loop (`dec`, `jnz`), so that in Bochs, where the TSC counts instructions, its share of the
/// samples is known by construction. Not inlined, with its own symbol; the `mov` of `$tag` (a
/// constant distinct per function) keeps the bodies distinct, so the linker cannot fold them.
#[macro_export]
macro_rules! countdown {
    ($name:ident, $tag:literal) => {
        /// `iterations` rounds of a two-instruction loop.
        #[inline(never)]
        #[unsafe(no_mangle)]
        pub extern "C" fn $name(iterations: u64) {
            if iterations == 0 {
                return;
            }
            // SAFETY: a register-only countdown loop; no memory, no flags the compiler relies on.
            unsafe {
                core::arch::asm!(
                    "mov {id:e}, {tag}",
                    "2:",
                    "dec {n}",
                    "jnz 2b",
                    n = inout(reg) iterations => _,
                    id = out(reg) _,
                    tag = const $tag,
                    options(nomem, nostack),
                );
            }
        }
    };
}
#[cfg(target_os = "none")]
pub use rt::exit;

/// Exit codes shared by all guests (the value written to port 0xf4).
pub mod exit_code {
    /// Wrong or missing arguments (the guest prints what it expected).
    pub const BAD_ARGS: u8 = 2;
    /// The attack guest's access came back (the hypervisor should have stopped the VM).
    pub const ESCAPED: u8 = 0xaa;
    /// An exception no fixup entry expected.
    pub const UNEXPECTED_EXCEPTION: u8 = 0xee;
    /// A Rust panic.
    pub const PANIC: u8 = 0xef;
}

/// Names a guest's main function: `fn(args: &str) -> u8`, whose result is the exit code.
///
/// The runtime calls it through the `__hvprof_guest_main` symbol this macro defines.
#[macro_export]
macro_rules! guest_entry {
    ($main:path) => {
        #[doc(hidden)]
        #[unsafe(no_mangle)]
        pub fn __hvprof_guest_main(args: &'static str) -> u8 {
            let main: fn(&'static str) -> u8 = $main;
            main(args)
        }
    };
}

/// Prints to the virtual 16550 (COM1).
#[cfg(target_os = "none")]
#[macro_export]
macro_rules! print {
    ($($arg:tt)*) => {
        $crate::serial::_print(::core::format_args!($($arg)*))
    };
}

/// Prints a line to the virtual 16550 (COM1); the hypervisor console prints complete lines.
#[cfg(target_os = "none")]
#[macro_export]
macro_rules! println {
    () => {
        $crate::serial::_print(::core::format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::serial::_print(::core::format_args!("{}\n", ::core::format_args!($($arg)*)))
    };
}
