//! `attack`: tries to reach memory outside the VM; the hypervisor must stop it on the EPT
//! violation.
//!
//! Arguments: `attack=read|write|exec` and `addr=0x...` (the loader resolves `target=` to
//! `addr=`). The guest maps `addr` in its own page tables (a 4 KiB identity page; the
//! hypervisor's map covers only `[0, mem)`), prints `attack: <kind> at GPA <addr>`, then does an
//! 8-byte volatile read, an 8-byte write of 0x4141414141414141, or a `call` to the address.
//!
//! Exit codes: 0xAA (`attack: ESCAPED`) if the access comes back, 2 for bad arguments, 3 when
//! the address cannot be reached from the guest at all (not canonical, or at or above the
//! guest's MAXPHYADDR, where its own page walk would #PF before any EPT check), 4 when the page
//! tables cannot be extended. An unexpected exception exits with 0xEE as usual.
#![no_std]
#![no_main]

use hvprof_guests::paging::{self, MapError, Mapped};
use hvprof_guests::{arg, args::parse_u64, cpu, exit_code, println};

hvprof_guests::guest_entry!(main);

const UNREACHABLE: u8 = 3;
const NO_MAPPING: u8 = 4;
const PATTERN: u64 = 0x4141_4141_4141_4141;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Read,
    Write,
    Exec,
}

fn main(args: &str) -> u8 {
    let kind = match arg(args, "attack") {
        Some("read") => Kind::Read,
        Some("write") => Kind::Write,
        Some("exec") => Kind::Exec,
        other => {
            println!(
                "attack: bad argument attack={}: expected read, write or exec",
                other.unwrap_or("")
            );
            return exit_code::BAD_ARGS;
        }
    };
    let Some(addr) = arg(args, "addr").and_then(parse_u64) else {
        println!("attack: bad or missing argument addr=: expected an address (0x...)");
        return exit_code::BAD_ARGS;
    };
    let name = match kind {
        Kind::Read => "read",
        Kind::Write => "write",
        Kind::Exec => "exec",
    };
    println!("attack: {name} at GPA {addr:#x}");

    let phys_bits = cpu::max_phys_addr_bits();
    // The last byte touched: an 8-byte data access may cross into the next page.
    let last = if kind == Kind::Exec {
        addr
    } else {
        addr.wrapping_add(7)
    };
    if phys_bits < 64 && (addr >> phys_bits != 0 || last >> phys_bits != 0) {
        println!(
            "attack: {addr:#x} is beyond the guest's MAXPHYADDR ({phys_bits} bits): not reachable"
        );
        return UNREACHABLE;
    }
    // One page, or two when an 8-byte access crosses a page boundary.
    let pages = if last >> 12 == addr >> 12 { 1 } else { 2 };
    for page in [addr, last].into_iter().take(pages) {
        // SAFETY: CR3 holds the hypervisor's identity map, whose tables are inside guest memory
        // at their physical addresses; the new page is outside the guest image and stack.
        match unsafe { paging::map_identity(page) } {
            Ok(Mapped::New { .. }) => {}
            Ok(Mapped::Existing) => {
                println!("attack: note: {page:#x} is already mapped (inside this guest's memory?)");
            }
            Err(MapError::NotCanonical) => {
                println!("attack: {page:#x} is not a canonical address: not reachable");
                return UNREACHABLE;
            }
            Err(MapError::OutOfTables) => {
                println!("attack: out of page-table pages mapping {page:#x}");
                return NO_MAPPING;
            }
        }
    }

    let ptr = addr as *mut u64;
    match kind {
        Kind::Read => {
            // SAFETY: deliberately not safe: the point is to be stopped by the EPT. The page is
            // mapped above, so only the EPT can refuse the access.
            let value = unsafe { ptr.read_volatile() };
            println!("attack: ESCAPED (read {value:#x})");
        }
        Kind::Write => {
            // SAFETY: as for the read; the page is mapped above.
            unsafe { ptr.write_volatile(PATTERN) };
            println!("attack: ESCAPED (wrote {PATTERN:#x})");
        }
        Kind::Exec => {
            // SAFETY: as for the read: the fetch from `addr` must stop the VM. Should it run,
            // whatever is there is treated as a C function.
            unsafe { core::arch::asm!("call {}", in(reg) addr, clobber_abi("C")) };
            println!("attack: ESCAPED (call returned)");
        }
    }
    exit_code::ESCAPED
}
