//! `hello`: the smallest guest. Prints `hello from <vm>` on the serial port and
//! `hello via hypercall` through the PRINT hypercall, then exits.
//!
//! Arguments: `vm=<name>` (printed; `guest` when absent), `code=N` (exit code, default 42),
//! `exit=hypercall` (leave through the EXIT hypercall instead of port 0xf4).
#![no_std]
#![no_main]

use hvprof_guests::{arg, arg_num, exit_code, hypercall, println};

hvprof_guests::guest_entry!(main);

fn main(args: &str) -> u8 {
    let code = match arg_num(args, "code", 42) {
        Ok(c) if c <= 0xff => c as u8,
        Ok(c) => {
            println!("hello: bad argument code={c}: expected 0..=255");
            return exit_code::BAD_ARGS;
        }
        Err(e) => {
            println!("hello: {e}");
            return exit_code::BAD_ARGS;
        }
    };
    let vm = arg(args, "vm").unwrap_or("guest");
    println!("hello from {vm}");
    let result = hypercall::print(b"hello via hypercall\n");
    if result != 0 {
        println!("hello: PRINT hypercall returned {result:#x}");
    }
    match arg(args, "exit") {
        Some("hypercall") => hypercall::exit(code),
        None | Some("port") => code,
        Some(other) => {
            println!("hello: bad argument exit={other}: expected port or hypercall");
            exit_code::BAD_ARGS
        }
    }
}
