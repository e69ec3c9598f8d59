//! `cargo xtask spread-code`: a CPU-bound workload whose time is spread over many distinct code
//! addresses, for `cargo xtask bench` to record with `perf record`. `perf report` on its
//! perf.data then reads a profile of the shape of the analyzer's synthetic capture (some
//! 10 M samples over hundreds of thousands of addresses without symbols, each its own row),
//! where a busy shell loop gives a profile of a handful of rows, which `perf report` reads
//! several times faster per sample.
//!
//! The code is an anonymous mapping of NOP sleds, each 1 KiB ending in a RET, called at
//! pseudo-random places on every core: every byte of the mapping is an instruction a sample
//! can land on, and no symbol names any of them.

use anyhow::{Result, bail};
use std::time::{Duration, Instant};

/// Bytes per sled: the last is a RET, the others NOPs.
#[cfg(target_arch = "x86_64")]
const SLED: usize = 1024;

/// Calls into `bytes` of NOP sleds (rounded up to whole sleds) on every core for `seconds`.
#[cfg(target_arch = "x86_64")]
pub fn spread_code(bytes: usize, seconds: f64) -> Result<()> {
    const NOP: u8 = 0x90;
    const RET: u8 = 0xc3;
    let len = bytes.max(1).next_multiple_of(SLED);
    let run_for = Duration::try_from_secs_f64(seconds)
        .map_err(|e| anyhow::anyhow!("--seconds {seconds}: {e}"))?;
    // SAFETY: a fresh private anonymous mapping (no address asked for, no file): it aliases
    // nothing of this process's memory. The result is checked before it is used.
    let map = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if map == libc::MAP_FAILED {
        bail!(
            "cannot map {len} bytes: {}",
            std::io::Error::last_os_error()
        );
    }
    {
        // SAFETY: `map` is a readable and writable mapping of `len` bytes, just made, which
        // nothing else refers to while this slice lives.
        let code = unsafe { std::slice::from_raw_parts_mut(map.cast::<u8>(), len) };
        code.fill(NOP);
        for end in code.iter_mut().skip(SLED - 1).step_by(SLED) {
            *end = RET;
        }
    }
    // Never writable and executable at once.
    // SAFETY: `map` and `len` are the mapping made above; no slice of it is alive.
    if unsafe { libc::mprotect(map, len, libc::PROT_READ | libc::PROT_EXEC) } != 0 {
        let why = std::io::Error::last_os_error();
        // SAFETY: the mapping made above, which nothing refers to.
        unsafe { libc::munmap(map, len) };
        bail!("cannot make the code executable: {why}");
    }
    let base = map as usize;
    let end = Instant::now() + run_for;
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    std::thread::scope(|s| {
        for core in 0..cores {
            s.spawn(move || {
                let mut x = 0x9e37_79b9_7f4a_7c15u64
                    ^ (core as u64 + 1).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                while Instant::now() < end {
                    for _ in 0..4096 {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        let at = (base + (x % len as u64) as usize) as *const u8;
                        // SAFETY: `at` is inside the mapping, which is readable and executable
                        // and stays mapped until every thread has ended: from any of its bytes,
                        // NOPs run to the RET that ends the sled, a function that takes no
                        // argument, touches no memory and no register the C calling
                        // convention asks a callee to keep.
                        let f = unsafe { std::mem::transmute::<*const u8, extern "C" fn()>(at) };
                        f();
                    }
                }
            });
        }
    });
    // SAFETY: the mapping made above; every thread that called into it has ended.
    unsafe { libc::munmap(map, len) };
    Ok(())
}

#[cfg(not(target_arch = "x86_64"))]
pub fn spread_code(_bytes: usize, _seconds: f64) -> Result<()> {
    bail!("the spread-code workload is x86_64 code")
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    /// The sleds run from wherever they are entered and return (a fault or a stray jump would
    /// end the test process), for sizes that are and are not whole sleds.
    #[test]
    fn runs_and_returns() {
        // A system that refuses executable anonymous memory (an SELinux `execmem` denial, say)
        // cannot run the workload at all: the bench then says `perf report` was not measured.
        if let Err(e) = super::spread_code(4096, 0.0) {
            let why = format!("{e:#}");
            if why.contains("executable")
                && (why.contains("Permission denied") || why.contains("not permitted"))
            {
                eprintln!("skipped: {why}");
                return;
            }
            panic!("{why}");
        }
        for bytes in [1, 1000, 4096, 100_000] {
            super::spread_code(bytes, 0.02).unwrap();
        }
        for seconds in [f64::NAN, f64::INFINITY, -1.0] {
            assert!(super::spread_code(4096, seconds).is_err(), "{seconds}");
        }
    }
}
