//! End-to-end scenarios of the VMX core: guests run under EPT, the exit handlers do what
//! docs/GUEST-ABI.md promises, attacks on memory outside a VM are stopped, and the exit
//! statistics equal what the guests did.
//!
//! The hypervisor's lines these checks read:
//! - `vm <name>: stopped: exit code <n> (<how>) after <t> ticks`
//! - `vm <name>: stopped: EPT violation: <access> to GPA <gpa> (...)` then `vm <name>:   guest RIP=...`
//! - `vm <name>: target <what> at host <hpa>: page checksum <a> before, <b> after: unchanged`
//! - `vm <name>: exit <REASON> <count> <total> <min> <max> <mean>` and `vm <name>: io port <port> <count>`

use crate::emulator::Emulator;
use crate::log::SerialLog;
use crate::runner::{ModuleSource, Scenario};
use crate::scenarios::HASWELL;

const HELLO: ModuleSource = ModuleSource::Guest("hello");

/// `vm <vm>: stopped: exit code <code> (<how>)`.
pub fn check_exit_code(log: &SerialLog, vm: &str, code: u8, how: &str) -> Result<(), String> {
    let prefix = format!("vm {vm}: stopped: ");
    let line = log.expect(&prefix)?;
    let want = format!("exit code {code} ({how})");
    if line.contains(&want) {
        Ok(())
    } else {
        Err(format!("VM {vm} did not stop with {want:?}: {line:?}"))
    }
}

/// The count column of `vm <vm>: exit <reason> ...`, 0 when the reason has no line.
pub fn exit_count(log: &SerialLog, vm: &str, reason: &str) -> Result<u64, String> {
    let prefix = format!("vm {vm}: exit {reason} ");
    match log.find(&prefix) {
        None => Ok(0),
        Some(line) => line[prefix.len()..]
            .split_whitespace()
            .next()
            .and_then(|n| n.parse().ok())
            .ok_or_else(|| format!("no count in {line:?}")),
    }
}

/// The count of `vm <vm>: io port <port> <count>`, 0 when the port has no line.
pub fn port_count(log: &SerialLog, vm: &str, port: u16) -> Result<u64, String> {
    let prefix = format!("vm {vm}: io port {port:#06x} ");
    match log.find(&prefix) {
        None => Ok(0),
        Some(line) => line[prefix.len()..]
            .trim()
            .parse()
            .map_err(|_| format!("no count in {line:?}")),
    }
}

fn expect_eq(what: &str, got: u64, want: u64) -> Result<(), String> {
    if got == want {
        Ok(())
    } else {
        Err(format!("{what}: {got}, expected {want}"))
    }
}

/// Every result, or every error joined.
pub fn all_of(results: impl IntoIterator<Item = Result<(), String>>) -> Result<(), String> {
    let errors: Vec<String> = results.into_iter().filter_map(Result::err).collect();
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors.join("; "))
    }
}

/// An attack stopped at its first access: the EPT-violation report names the access and the
/// GPA, the guest RIP follows, the target page (when RAM) is unchanged, the attack guest never
/// printed ESCAPED, and the VM after it ran to its exit.
fn check_attack(log: &SerialLog, access: &str, gpa: Option<u64>, ram: bool) -> Result<(), String> {
    let stopped = log.expect("vm attack: stopped: ");
    let mut results = vec![stopped.and_then(|line| {
        let want = match gpa {
            Some(gpa) => format!("EPT violation: {access} to GPA {gpa:#x}"),
            None => format!("EPT violation: {access} to GPA "),
        };
        if line.contains(&want) {
            Ok(())
        } else {
            Err(format!("the attack was not stopped by {want:?}: {line:?}"))
        }
    })];
    results.push(log.expect("vm attack:   guest RIP=").map(drop));
    results.push(log.expect_none("[attack] attack: ESCAPED"));
    if ram {
        results.push(
            log.expect_containing("vm attack: target ", "after: unchanged")
                .map(drop),
        );
    }
    results.push(check_exit_code(log, "after", 42, "port 0xf4"));
    all_of(results)
}

fn attack(
    name: &str,
    before: Option<&'static str>,
    args: &str,
    check: fn(&SerialLog) -> Result<(), String>,
) -> Scenario {
    let mut s = Scenario::new(name, Emulator::bochs(HASWELL));
    if let Some(vm) = before {
        s = s.module(&format!("{vm}.elf"), HELLO, &format!("vm={vm}"));
    }
    s.module(
        "attack.elf",
        ModuleSource::Guest("attack"),
        &format!("vm=attack mem=8M {args}"),
    )
    .module("after.elf", HELLO, "vm=after")
    .check(check)
}

/// A flat real-mode image (16-bit code loaded at 0000:7C00), hand-assembled: it prints its
/// message on COM1 with a `lodsb`/`out` loop, then writes 7 to the exit port.
///
/// ```text
/// 7c00  BA F8 03     mov dx, 0x3f8
/// 7c03  BE 13 7C     mov si, msg
/// 7c06  AC           lodsb
/// 7c07  84 C0        test al, al
/// 7c09  74 03        jz 7c0e
/// 7c0b  EE           out dx, al
/// 7c0c  EB F8        jmp 7c06
/// 7c0e  B0 07        mov al, 7
/// 7c10  E6 F4        out 0xf4, al
/// 7c12  F4           hlt
/// 7c13  msg: "hello from real mode\n", 0
/// ```
pub fn real_mode_image() -> Vec<u8> {
    let mut code = vec![
        0xba, 0xf8, 0x03, 0xbe, 0x13, 0x7c, 0xac, 0x84, 0xc0, 0x74, 0x03, 0xee, 0xeb, 0xf8, 0xb0,
        0x07, 0xe6, 0xf4, 0xf4,
    ];
    assert_eq!(code.len(), 0x13, "msg must start at 0x7c13");
    code.extend_from_slice(b"hello from real mode\n\0");
    code
}

/// The VMX-core scenarios.
pub fn all() -> Vec<Scenario> {
    vec![
        // A flat real-mode image under unrestricted guest, then a 64-bit guest.
        Scenario::new("bochs-vm-real-mode", Emulator::bochs(HASWELL))
            .module("boot.bin", ModuleSource::Bytes(real_mode_image()), "vm=real format=real16")
            .module("after.elf", HELLO, "vm=after")
            .check(|log| {
                all_of([
                    log.expect("module 0: boot.bin").and_then(|l| {
                        if l.contains("flat real-mode image") {
                            Ok(())
                        } else {
                            Err(format!("not reported as a real-mode image: {l:?}"))
                        }
                    }),
                    log.expect("[real] hello from real mode").map(drop),
                    check_exit_code(log, "real", 7, "port 0xf4"),
                    check_exit_code(log, "after", 42, "port 0xf4"),
                ])
            }),
        // hello through both exits: the exit port and the EXIT hypercall.
        Scenario::new("bochs-vm-hello", Emulator::bochs(HASWELL))
            .module("hello.elf", HELLO, "vm=hello code=42")
            .module("hello2.elf", HELLO, "vm=hello2 code=7 exit=hypercall")
            .check(|log| {
                all_of([
                    log.expect("[hello] hello from hello").map(drop),
                    log.expect("[hello] hello via hypercall").map(drop),
                    check_exit_code(log, "hello", 42, "port 0xf4"),
                    log.expect("[hello2] hello from hello2").map(drop),
                    check_exit_code(log, "hello2", 7, "EXIT hypercall"),
                ])
            }),
        // The CPUID/MSR/I/O policy, asserted from inside the guest.
        Scenario::new("bochs-vm-probe", Emulator::bochs(HASWELL))
            .module("probe.elf", ModuleSource::Guest("probe"), "vm=probe")
            .check(|log| {
                all_of([
                    log.expect_none("[probe] probe: FAIL"),
                    log.expect_containing("[probe] probe: ", " passed, 0 failed").map(drop),
                    check_exit_code(log, "probe", 0, "port 0xf4"),
                ])
            }),
        // Exit statistics equal what the guest did: N CPUIDs, M OUTs to port 0x2e8, K VMCALLs.
        Scenario::new("bochs-vm-exit-stats", Emulator::bochs(HASWELL))
            .module("busy.elf", ModuleSource::Guest("busy"), "vm=busy cpuid=1000 io=300 vmcall=200")
            .check(|log| {
                let count = |reason| exit_count(log, "busy", reason);
                all_of([
                    check_exit_code(log, "busy", 0, "port 0xf4"),
                    count("CPUID").and_then(|n| expect_eq("CPUID exits", n, 1000)),
                    count("VMCALL").and_then(|n| expect_eq("VMCALL exits", n, 200)),
                    port_count(log, "busy", 0x2e8).and_then(|n| expect_eq("exits on port 0x2e8", n, 300)),
                    // Every I/O exit is on one of the ports listed.
                    count("IO_INSTRUCTION").and_then(|io| {
                        let ports: Result<Vec<u64>, String> =
                            [0x2e8, 0x3f8, 0x3fd, 0xf4].iter().map(|p| port_count(log, "busy", *p)).collect();
                        expect_eq("I/O exits vs. the per-port counts", io, ports?.iter().sum())
                    }),
                ])
            }),
        // A guest that never stops is stopped by the VMX-preemption timer at its budget, and
        // the timer also fired at every sampling period on the way.
        Scenario::new("bochs-vm-budget", Emulator::bochs(HASWELL))
            .cmdline("period=100000ticks slice=1000ms")
            .module("busy.elf", ModuleSource::Guest("busy"), "vm=spin spin=100000000 budget=3000000")
            .module("after.elf", HELLO, "vm=after")
            .check(|log| {
                all_of([
                    log.expect_containing("vm spin: stopped: ", "run budget of 3000000 ticks exhausted").map(drop),
                    exit_count(log, "spin", "PREEMPTION_TIMER").and_then(|n| {
                        if (20..=40).contains(&n) {
                            Ok(())
                        } else {
                            Err(format!("{n} preemption-timer exits for 3,000,000 ticks at a 100,000-tick period"))
                        }
                    }),
                    check_exit_code(log, "after", 42, "port 0xf4"),
                ])
            }),
        attack(
            "bochs-attack-write-hypervisor",
            None,
            "attack=write target=hypervisor",
            |log| check_attack(log, "write", Some(0x100_0000), true),
        ),
        attack(
            "bochs-attack-read-other-vm",
            Some("victim"),
            "attack=read target=vm:victim",
            |log| check_attack(log, "read", None, true),
        ),
        attack(
            "bochs-attack-exec-unmapped",
            None,
            "attack=exec target=unmapped",
            |log| check_attack(log, "fetch", Some(0xc000_0000), false),
        ),
        attack(
            "bochs-attack-write-mmio",
            None,
            "attack=write target=mmio",
            |log| check_attack(log, "write", Some(0xfee0_0000), false),
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOG: &str = "vm busy: running\r\n\
        [busy] busy: done cpuid=3 io=2 vmcall=1\r\n\
        vm busy: stopped: exit code 0 (port 0xf4) after 100 ticks\r\n\
        vm busy: exits: 8 in all; handler cost in TSC ticks, VM exit to VM entry\r\n\
        vm busy: exit reason                      count          total       min       max      mean\r\n\
        vm busy: exit CPUID                          3            870       290       290       290\r\n\
        vm busy: exit IO_INSTRUCTION                 4           1000       250       250       250\r\n\
        vm busy: exit VMCALL                         1            315       315       315       315\r\n\
        vm busy: io port 0x02e8          2\r\n\
        vm busy: io port 0x00f4          1\r\n";

    #[test]
    fn counts_are_read_from_the_table() {
        let log = SerialLog::new(LOG);
        assert_eq!(exit_count(&log, "busy", "CPUID"), Ok(3));
        assert_eq!(exit_count(&log, "busy", "HLT"), Ok(0));
        assert_eq!(port_count(&log, "busy", 0x2e8), Ok(2));
        assert_eq!(port_count(&log, "busy", 0x3f8), Ok(0));
        assert_eq!(check_exit_code(&log, "busy", 0, "port 0xf4"), Ok(()));
        assert!(check_exit_code(&log, "busy", 1, "port 0xf4").is_err());
        assert!(check_exit_code(&log, "other", 0, "port 0xf4").is_err());
    }
}
