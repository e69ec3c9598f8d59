//! A VM's configuration from its boot module's command line (docs/GUEST-ABI.md, "The module"):
//! `<image-name> vm=<name> mem=<size> [budget=<ticks>] [target=...] [other key=value ...]`.
//! Keys the hypervisor does not know are passed through to the guest.

use core::fmt;

pub const MIB: u64 = 1 << 20;
/// Guest memory is allocated and EPT-mapped in 2 MiB pages.
pub const MEM_GRANULE: u64 = 2 * MIB;
pub const MEM_MIN: u64 = 4 * MIB;
/// Four page directories in the guest's boot page tables map at most 4 GiB.
pub const MEM_MAX: u64 = 4 << 30;
pub const MEM_DEFAULT: u64 = 16 * MIB;
/// Default run budget in TSC ticks (in Bochs, instructions): a guest that never stops is stopped.
pub const BUDGET_DEFAULT: u64 = 2_000_000_000;
/// The default wall budget, in multiples of the run budget: room for a VM that halts, waits for
/// its timer or is preempted most of its life, but an end.
pub const WALL_PER_BUDGET: u64 = 8;
pub const NAME_MAX: usize = 32;
pub const VCPUS_MAX: u16 = 8;

/// What an attack guest aims at (resolved by the loader to a host-physical address).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target<'a> {
    Hypervisor,
    Vm(&'a str),
    Unmapped,
    Mmio,
}

/// What the module holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Format {
    /// An ELF64 x86-64 executable, started in 64-bit mode (docs/GUEST-ABI.md).
    #[default]
    Elf64,
    /// A flat real-mode image, loaded at 0000:7C00 and started there in real mode under
    /// unrestricted guest (like a boot sector).
    Real16,
    /// A Linux bzImage, started through the 64-bit boot protocol (`linux_boot`). The module's
    /// arguments without the hypervisor's keys are the kernel command line.
    Linux,
    /// A Multiboot 1 kernel (an ELF32 executable, or an image whose header gives its load
    /// addresses), started in 32-bit protected mode as the Multiboot Specification says
    /// (`multiboot`). The module's arguments without the hypervisor's keys are its command line;
    /// `initrd=` names its one module.
    Multiboot,
}

/// `ple=`: what a spinning vCPU does (PAUSE-loop exiting, SDM Vol. 3C §25.6.13 and §26.1.3).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Ple {
    /// No PAUSE-loop exits: a vCPU that spins keeps its pCPU to the end of its slice.
    #[default]
    Off,
    /// A PAUSE loop at CPL 0 longer than the window exits, and the vCPU gives up the rest of its
    /// slice to the next vCPU in turn.
    On,
    /// As `On`, and the pCPU goes first to a preempted vCPU of the same VM (the lock holder or
    /// the IPI target the spinner waits for, likely): KVM's directed yield.
    Directed,
}

/// `vpmu=`: the guest's virtual PMU (docs/PROFILER.md, "A guest's own PMU"): Du et al.'s two
/// ways of accounting a vCPU's counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Vpmu {
    /// No PMU: CPUID leaf 0AH is all zeros, the counter MSRs and RDPMC are #GP.
    #[default]
    Off,
    /// *CPU switch*: the counters run only while the vCPU executes guest code.
    Cpu,
    /// *Domain switch*: they also count the hypervisor's work on the vCPU's exits (as OS-mode
    /// time: the hypervisor runs privileged).
    Domain,
}

impl Vpmu {
    /// The value as `vpmu=` takes it.
    pub fn as_str(self) -> &'static str {
        match self {
            Vpmu::Off => "off",
            Vpmu::Cpu => "cpu",
            Vpmu::Domain => "domain",
        }
    }
}

impl Ple {
    /// The value as `ple=` takes it.
    pub fn as_str(self) -> &'static str {
        match self {
            Ple::Off => "off",
            Ple::On => "on",
            Ple::Directed => "directed",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VmConfig<'a> {
    pub name: &'a str,
    pub format: Format,
    pub mem: u64,
    /// vCPUs, 1 to `VCPUS_MAX`.
    pub vcpus: u16,
    pub budget: u64,
    /// `wall-budget=<ticks>`: TSC ticks from the VM's start after which it is stopped, running
    /// or not (a guest that halts with its timer at the end of time must not hold the machine).
    /// Default: `WALL_PER_BUDGET` times `budget`.
    pub wall_budget: u64,
    pub target: Option<Target<'a>>,
    /// `pin=a,b,...`: the pCPU each vCPU runs on (one per vCPU); `None`: free to move.
    pub pin: Option<Pins>,
    /// `initrd=<module name>`: the module holding a Linux guest's initrd (a Multiboot guest's
    /// one module).
    pub initrd: Option<&'a str>,
    /// `task-offsets=current_task:pid:tgid:comm`: where a Linux guest keeps its running task
    /// (derived on the host from the kernel image), so samples name guest processes.
    pub task_offsets: Option<hvprof_samplelog::TaskOffsets>,
    /// `mm-layout=` (22 numbers, `linux-guest`'s derivation from the kernel's BTF): where a
    /// Linux guest keeps a process's memory map, to name the files its processes run.
    pub mm_layout: Option<hvprof_linux_walk::MmLayout>,
    /// `module-layout=` (`linux-guest`'s derivation from kallsyms and BTF): where a Linux
    /// guest's module list is, to name the kernel modules its samples fall in.
    pub module_layout: Option<hvprof_linux_walk::ModuleLayout>,
    /// `orc-layout=` (`linux-guest`'s derivation from the kernel image's sections): where a
    /// Linux guest's ORC unwind tables are, to walk its kernel call chains (`stacks=`).
    pub orc_layout: Option<hvprof_linux_walk::OrcLayout>,
    /// `unwind=<module>[,<module>...]`: boot modules holding unwind tables of the guest's
    /// programs built without frame pointers (`hvprof-analyze unwind-table`), for their call
    /// chains (`stacks=`); at most `UNWIND_MAX`, see `unwind_modules`.
    pub unwind: Option<&'a str>,
    /// `apic=on|emulated|off` (Linux and 64-bit test guests; default off): a local APIC per vCPU
    /// (xAPIC), the I/O APIC, ACPI PM1 and ACPI tables describing them (docs/LINUX-GUESTS.md,
    /// docs/GUEST-ABI.md). Off, a Linux guest has the 8259 pair and the PIT only and must boot
    /// with `acpi=off nolapic`.
    pub apic: bool,
    /// With `apic=on`, the CPU's APIC virtualization where it has it (TPR shadow, APIC-register
    /// virtualization, virtual-interrupt delivery); `apic=emulated` traps and emulates every
    /// access instead, as a CPU without them does.
    pub apic_virtualization: bool,
    /// `output=<size>` (K, M or G): bytes the VM's programs may hand the hypervisor through the
    /// output leaf (docs/GUEST-ABI.md), kept and sent after the run as output frames; 0 (the
    /// default): no output leaf.
    pub output: u64,
    /// `ple=off|on|directed` (default off): pause-loop exiting and what a PLE exit does.
    pub ple: Ple,
    /// `vpmu=off|cpu|domain` (default off): a virtual architectural PMU per vCPU.
    pub vpmu: Vpmu,
    /// `testdev=on|off` (default off): QEMU's pc-testdev ports, which kvm-unit-tests' kernels
    /// drive (`devices::testdev`): a scratch register, a page flush, the ISA interrupt lines
    /// raised by hand, and 64 KiB of test memory at 0xff000000.
    pub testdev: bool,
    /// Every argument after the image name, passed to the guest as is.
    pub args: &'a str,
}

/// The largest `output=`.
pub const OUTPUT_MAX: u64 = 1 << 30;

/// The most unwind tables one VM takes.
pub const UNWIND_MAX: usize = 4;

impl<'a> VmConfig<'a> {
    /// The modules `unwind=` names (none without it).
    pub fn unwind_modules(&self) -> impl Iterator<Item = &'a str> {
        self.unwind.into_iter().flat_map(|v| v.split(','))
    }
}

/// The pCPU of each vCPU, as `pin=` gives them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pins {
    cpus: [u16; VCPUS_MAX as usize],
    len: usize,
}

impl Pins {
    /// The pCPU of vCPU `i`.
    pub fn get(&self, i: usize) -> Option<u16> {
        self.as_slice().get(i).copied()
    }

    pub fn as_slice(&self) -> &[u16] {
        &self.cpus[..self.len]
    }
}

/// pCPUs are numbered 0 to this (exclusive) in `pin=`.
pub const PCPUS_MAX: u16 = 64;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConfigError<'a> {
    NoImageName,
    BadName(&'a str),
    BadMem(&'a str),
    MemRange(u64),
    BadBudget(&'a str),
    BadWallBudget(&'a str),
    BadTarget(&'a str),
    BadFormat(&'a str),
    BadVcpus(&'a str),
    BadPin(&'a str),
    BadInitrd,
    BadTaskOffsets(&'a str),
    BadMmLayout(&'a str),
    BadModuleLayout(&'a str),
    BadOrcLayout(&'a str),
    BadUnwind(&'a str),
    BadApic(&'a str),
    BadOutput(&'a str),
    BadPle(&'a str),
    BadTestdev(&'a str),
    BadVpmu(&'a str),
    PinCount { pins: usize, vcpus: u16 },
    Repeated(&'a str),
}

impl fmt::Display for ConfigError<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigError::NoImageName => f.write_str("the module command line has no image name"),
            ConfigError::BadName(n) => write!(
                f,
                "vm={n:?}: a VM name is 1-{NAME_MAX} characters of [A-Za-z0-9_.-]"
            ),
            ConfigError::BadMem(v) => write!(
                f,
                "mem={v:?}: expected a size with a K, M or G suffix, e.g. mem=16M"
            ),
            ConfigError::MemRange(b) => write!(
                f,
                "mem={} KiB: guest memory must be a multiple of 2 MiB between {} MiB and {} GiB",
                b >> 10,
                MEM_MIN >> 20,
                MEM_MAX >> 30
            ),
            ConfigError::BadBudget(v) => {
                write!(f, "budget={v:?}: expected a positive number of TSC ticks")
            }
            ConfigError::BadWallBudget(v) => {
                write!(
                    f,
                    "wall-budget={v:?}: expected a positive number of TSC ticks"
                )
            }
            ConfigError::BadTarget(v) => write!(
                f,
                "target={v:?}: expected hypervisor, vm:<name>, unmapped or mmio"
            ),
            ConfigError::BadFormat(v) => {
                write!(
                    f,
                    "format={v:?}: expected elf64, real16, linux or multiboot"
                )
            }
            ConfigError::BadVcpus(v) => {
                write!(
                    f,
                    "vcpus={v:?}: expected a number of vCPUs from 1 to {VCPUS_MAX}"
                )
            }
            ConfigError::BadPin(v) => write!(
                f,
                "pin={v:?}: expected pCPU numbers (0 to {}) separated by commas, one per vCPU",
                PCPUS_MAX - 1
            ),
            ConfigError::BadInitrd => f.write_str("initrd= needs the name of a boot module"),
            ConfigError::BadTaskOffsets(v) => write!(
                f,
                "task-offsets={v:?}: expected current_task:pid:tgid:comm (decimal or 0x-hex)"
            ),
            ConfigError::BadModuleLayout(v) => write!(
                f,
                "module-layout={v:?}: expected modules:entry_SYSCALL_64:list:name:name_len:base:size (manifest.json's module_layout)"
            ),
            ConfigError::BadOrcLayout(v) => write!(
                f,
                "orc-layout={v:?}: expected entry_SYSCALL_64:_stext:_etext:_sinittext:_einittext:orc_unwind_ip:orc_unwind:count:orc_lookup:blocks (manifest.json's orc_layout)"
            ),
            ConfigError::BadApic(v) => write!(f, "apic={v:?}: expected on, emulated or off"),
            ConfigError::BadOutput(v) => write!(
                f,
                "output={v:?}: expected a size with a K, M or G suffix up to 1G, e.g. output=16M"
            ),
            ConfigError::BadPle(v) => write!(f, "ple={v:?}: expected off, on or directed"),
            ConfigError::BadTestdev(v) => write!(f, "testdev={v:?}: expected on or off"),
            ConfigError::BadVpmu(v) => write!(f, "vpmu={v:?}: expected off, cpu or domain"),
            ConfigError::BadUnwind(v) => write!(
                f,
                "unwind={v:?}: expected 1 to {UNWIND_MAX} boot module names separated by commas"
            ),
            ConfigError::BadMmLayout(v) => write!(
                f,
                "mm-layout={v:?}: expected the 22 numbers linux-guest derives from the kernel's BTF (manifest.json's mm_layout)"
            ),
            ConfigError::PinCount { pins, vcpus } => write!(
                f,
                "pin= names {pins} pCPU{} but the VM has {vcpus} vCPU{}: give one pCPU per vCPU",
                if *pins == 1 { "" } else { "s" },
                if *vcpus == 1 { "" } else { "s" }
            ),
            ConfigError::Repeated(k) => write!(f, "{k}= given twice"),
        }
    }
}

/// Parses a module command line (the image name first).
pub fn parse(cmdline: &str) -> Result<VmConfig<'_>, ConfigError<'_>> {
    let cmdline = cmdline.trim();
    let mut words = cmdline.split_whitespace();
    let image = words.next().ok_or(ConfigError::NoImageName)?;
    let args = cmdline[image.len()..].trim_start();
    let mut name = None;
    let mut mem = None;
    let mut budget = None;
    let mut wall_budget = None;
    let mut target = None;
    let mut format = None;
    let mut vcpus = None;
    let mut pin = None;
    let mut initrd = None;
    let mut task_offsets = None;
    let mut mm_layout = None;
    let mut module_layout = None;
    let mut orc_layout = None;
    let mut unwind = None;
    let mut apic = None;
    let mut output = None;
    let mut ple = None;
    let mut testdev = None;
    let mut vpmu = None;
    let positive = |v: &str| v.parse::<u64>().ok().filter(|&n| n > 0);
    for word in words {
        let Some((key, value)) = word.split_once('=') else {
            continue;
        };
        match key {
            "vm" => set(&mut name, key, parse_name(value)?)?,
            "mem" => set(&mut mem, key, parse_mem(value)?)?,
            "budget" => set(
                &mut budget,
                key,
                positive(value).ok_or(ConfigError::BadBudget(value))?,
            )?,
            "wall-budget" => set(
                &mut wall_budget,
                key,
                positive(value).ok_or(ConfigError::BadWallBudget(value))?,
            )?,
            "target" => set(&mut target, key, parse_target(value)?)?,
            "vcpus" => set(
                &mut vcpus,
                key,
                value
                    .parse::<u16>()
                    .ok()
                    .filter(|n| (1..=VCPUS_MAX).contains(n))
                    .ok_or(ConfigError::BadVcpus(value))?,
            )?,
            "pin" => set(&mut pin, key, parse_pins(value)?)?,
            "task-offsets" => set(
                &mut task_offsets,
                key,
                Some(
                    hvprof_samplelog::TaskOffsets::parse(value)
                        .ok_or(ConfigError::BadTaskOffsets(value))?,
                ),
            )?,
            "mm-layout" => set(
                &mut mm_layout,
                key,
                Some(
                    hvprof_linux_walk::MmLayout::parse(value)
                        .ok_or(ConfigError::BadMmLayout(value))?,
                ),
            )?,
            "module-layout" => set(
                &mut module_layout,
                key,
                Some(
                    hvprof_linux_walk::ModuleLayout::parse(value)
                        .ok_or(ConfigError::BadModuleLayout(value))?,
                ),
            )?,
            "orc-layout" => set(
                &mut orc_layout,
                key,
                Some(
                    hvprof_linux_walk::OrcLayout::parse(value)
                        .ok_or(ConfigError::BadOrcLayout(value))?,
                ),
            )?,
            "output" => set(
                &mut output,
                key,
                parse_size(value)
                    .filter(|n| (1..=OUTPUT_MAX).contains(n))
                    .ok_or(ConfigError::BadOutput(value))?,
            )?,
            "ple" => set(
                &mut ple,
                key,
                match value {
                    "off" => Ple::Off,
                    "on" => Ple::On,
                    "directed" => Ple::Directed,
                    _ => return Err(ConfigError::BadPle(value)),
                },
            )?,
            "vpmu" => set(
                &mut vpmu,
                key,
                match value {
                    "off" => Vpmu::Off,
                    "cpu" => Vpmu::Cpu,
                    "domain" => Vpmu::Domain,
                    _ => return Err(ConfigError::BadVpmu(value)),
                },
            )?,
            "testdev" => set(
                &mut testdev,
                key,
                match value {
                    "on" => true,
                    "off" => false,
                    _ => return Err(ConfigError::BadTestdev(value)),
                },
            )?,
            "apic" => set(
                &mut apic,
                key,
                match value {
                    "on" => (true, true),
                    "emulated" => (true, false),
                    "off" => (false, false),
                    _ => return Err(ConfigError::BadApic(value)),
                },
            )?,
            "unwind" => set(
                &mut unwind,
                key,
                Some(value)
                    .filter(|v| {
                        let n = v.split(',').count();
                        n <= UNWIND_MAX && v.split(',').all(|m| !m.is_empty())
                    })
                    .ok_or(ConfigError::BadUnwind(value))?,
            )?,
            "initrd" => set(
                &mut initrd,
                key,
                Some(value)
                    .filter(|v| !v.is_empty())
                    .ok_or(ConfigError::BadInitrd)?,
            )?,
            "format" => set(
                &mut format,
                key,
                match value {
                    "elf64" => Format::Elf64,
                    "real16" => Format::Real16,
                    "linux" => Format::Linux,
                    "multiboot" => Format::Multiboot,
                    _ => return Err(ConfigError::BadFormat(value)),
                },
            )?,
            _ => {}
        }
    }
    let default_name = image
        .strip_suffix(".elf")
        .or_else(|| image.strip_suffix(".bin"))
        .unwrap_or(image);
    let vcpus = vcpus.unwrap_or(1);
    if let Some(p) = pin
        && p.len != usize::from(vcpus)
    {
        return Err(ConfigError::PinCount { pins: p.len, vcpus });
    }
    Ok(VmConfig {
        name: match name {
            Some(n) => n,
            None => parse_name(default_name).map_err(|_| ConfigError::BadName(default_name))?,
        },
        format: format.unwrap_or_default(),
        mem: mem.unwrap_or(MEM_DEFAULT),
        vcpus,
        pin,
        initrd,
        task_offsets: task_offsets.flatten(),
        mm_layout: mm_layout.flatten(),
        module_layout: module_layout.flatten(),
        orc_layout: orc_layout.flatten(),
        unwind,
        apic: apic.is_some_and(|(on, _)| on),
        apic_virtualization: apic.is_some_and(|(_, virtualized)| virtualized),
        output: output.unwrap_or(0),
        ple: ple.unwrap_or_default(),
        vpmu: vpmu.unwrap_or_default(),
        testdev: testdev.unwrap_or(false),
        budget: budget.unwrap_or(BUDGET_DEFAULT),
        wall_budget: wall_budget.unwrap_or_else(|| {
            budget
                .unwrap_or(BUDGET_DEFAULT)
                .saturating_mul(WALL_PER_BUDGET)
        }),
        target,
        args,
    })
}

fn set<'a, T>(slot: &mut Option<T>, key: &'a str, value: T) -> Result<(), ConfigError<'a>> {
    if slot.is_some() {
        return Err(ConfigError::Repeated(key));
    }
    *slot = Some(value);
    Ok(())
}

fn parse_name(n: &str) -> Result<&str, ConfigError<'_>> {
    let ok = !n.is_empty()
        && n.len() <= NAME_MAX
        && n.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b));
    if ok {
        Ok(n)
    } else {
        Err(ConfigError::BadName(n))
    }
}

/// The keys the hypervisor takes from a module's command line (the rest goes to the guest).
pub const KEYS: [&str; 19] = [
    "vm",
    "mem",
    "budget",
    "wall-budget",
    "target",
    "vcpus",
    "format",
    "pin",
    "initrd",
    "task-offsets",
    "mm-layout",
    "module-layout",
    "orc-layout",
    "unwind",
    "apic",
    "output",
    "ple",
    "testdev",
    "vpmu",
];

/// The module's arguments without the hypervisor's keys: a Linux guest's kernel command line.
pub fn guest_args(args: &str) -> impl Iterator<Item = &str> {
    args.split_whitespace()
        .filter(|w| !w.split_once('=').is_some_and(|(k, _)| KEYS.contains(&k)))
}

fn parse_pins(v: &str) -> Result<Pins, ConfigError<'_>> {
    let mut pins = Pins {
        cpus: [0; VCPUS_MAX as usize],
        len: 0,
    };
    for part in v.split(',') {
        let cpu = part
            .parse::<u16>()
            .ok()
            .filter(|&c| c < PCPUS_MAX)
            .ok_or(ConfigError::BadPin(v))?;
        *pins.cpus.get_mut(pins.len).ok_or(ConfigError::BadPin(v))? = cpu;
        pins.len += 1;
    }
    Ok(pins)
}

/// A size with a K, M or G suffix, in bytes (None: not one, or over 64 bits).
fn parse_size(v: &str) -> Option<u64> {
    let (digits, shift) = match v.as_bytes().last() {
        Some(b'K' | b'k') => (&v[..v.len() - 1], 10),
        Some(b'M' | b'm') => (&v[..v.len() - 1], 20),
        Some(b'G' | b'g') => (&v[..v.len() - 1], 30),
        _ => return None,
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    n.checked_shl(shift).filter(|b| b >> shift == n)
}

fn parse_mem(v: &str) -> Result<u64, ConfigError<'_>> {
    let bytes = parse_size(v).ok_or(ConfigError::BadMem(v))?;
    if !(MEM_MIN..=MEM_MAX).contains(&bytes) || !bytes.is_multiple_of(MEM_GRANULE) {
        return Err(ConfigError::MemRange(bytes));
    }
    Ok(bytes)
}

fn parse_target(v: &str) -> Result<Target<'_>, ConfigError<'_>> {
    match v {
        "hypervisor" => Ok(Target::Hypervisor),
        "unmapped" => Ok(Target::Unmapped),
        "mmio" => Ok(Target::Mmio),
        _ => match v.strip_prefix("vm:") {
            Some(name) => parse_name(name)
                .map(Target::Vm)
                .map_err(|_| ConfigError::BadTarget(v)),
            None => Err(ConfigError::BadTarget(v)),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn defaults_and_pass_through() {
        let c = parse("hello.elf code=7").unwrap();
        assert_eq!(c.name, "hello");
        assert_eq!(c.mem, MEM_DEFAULT);
        assert_eq!(c.budget, BUDGET_DEFAULT);
        assert_eq!(c.args, "code=7");
        let c = parse("attack.elf vm=a1 mem=8M attack=write target=vm:hello").unwrap();
        assert_eq!((c.name, c.mem), ("a1", 8 * MIB));
        assert_eq!(c.target, Some(Target::Vm("hello")));
        assert_eq!(c.args, "vm=a1 mem=8M attack=write target=vm:hello");
        assert_eq!(parse("x.elf mem=1G").unwrap().mem, 1 << 30);
        assert_eq!(parse("x.elf mem=6144K").unwrap().mem, 6 * MIB);
        assert_eq!(parse("x.elf").unwrap().format, Format::Elf64);
        assert_eq!(parse("x.elf").unwrap().vcpus, 1);
        assert_eq!(parse("x.elf").unwrap().vpmu, Vpmu::Off);
        assert_eq!(parse("x.elf vpmu=cpu").unwrap().vpmu, Vpmu::Cpu);
        assert_eq!(parse("x.elf vpmu=domain").unwrap().vpmu, Vpmu::Domain);
        assert_eq!(parse("x.elf vcpus=2").unwrap().vcpus, 2);
        assert_eq!(parse("x.elf vcpus=0"), Err(ConfigError::BadVcpus("0")));
        assert_eq!(parse("x.elf vcpus=9"), Err(ConfigError::BadVcpus("9")));
        assert_eq!(
            parse("boot.bin format=real16").unwrap().format,
            Format::Real16
        );
        assert_eq!(
            parse("boot.bin format=pe"),
            Err(ConfigError::BadFormat("pe"))
        );
    }

    #[test]
    fn refusals() {
        assert_eq!(parse("  "), Err(ConfigError::NoImageName));
        assert_eq!(parse("x.elf mem=3M"), Err(ConfigError::MemRange(3 * MIB)));
        assert_eq!(parse("x.elf mem=5M"), Err(ConfigError::MemRange(5 * MIB)));
        assert_eq!(parse("x.elf mem=8G"), Err(ConfigError::MemRange(8 << 30)));
        assert_eq!(parse("x.elf mem=16"), Err(ConfigError::BadMem("16")));
        assert_eq!(parse("x.elf mem=16M").unwrap().output, 0);
        assert_eq!(parse("x.elf output=16M").unwrap().output, 16 << 20);
        assert_eq!(parse("x.elf output=0M"), Err(ConfigError::BadOutput("0M")));
        assert_eq!(parse("x.elf output=2G"), Err(ConfigError::BadOutput("2G")));
        assert_eq!(
            parse("x.elf output=lots"),
            Err(ConfigError::BadOutput("lots"))
        );
        assert!(guest_args("x output=1M quiet").eq(["x", "quiet"]));
        assert_eq!(parse("x.elf").unwrap().ple, Ple::Off);
        for (v, want) in [
            ("off", Ple::Off),
            ("on", Ple::On),
            ("directed", Ple::Directed),
        ] {
            let line = format!("x.elf ple={v}");
            let c = parse(&line).unwrap();
            assert_eq!((c.ple, c.ple.as_str()), (want, v));
        }
        assert_eq!(parse("x.elf ple=yes"), Err(ConfigError::BadPle("yes")));
        assert_eq!(parse("x.elf testdev=1"), Err(ConfigError::BadTestdev("1")));
        assert_eq!(parse("x.elf vpmu=on"), Err(ConfigError::BadVpmu("on")));
        assert!(parse("x.elf testdev=on").unwrap().testdev);
        assert!(!parse("x.elf").unwrap().testdev);
        assert!(guest_args("testdev=on a=b").eq(["a=b"]));
        assert_eq!(
            parse("x.elf ple=on ple=off"),
            Err(ConfigError::Repeated("ple"))
        );
        assert!(guest_args("x ple=on quiet").eq(["x", "quiet"]));
        assert_eq!(
            parse("x.elf mem=99999999999999999999M"),
            Err(ConfigError::BadMem("99999999999999999999M"))
        );
        assert_eq!(parse("x.elf vm=a/b"), Err(ConfigError::BadName("a/b")));
        assert_eq!(parse("x.elf vm=a vm=b"), Err(ConfigError::Repeated("vm")));
        assert_eq!(parse("x.elf budget=0"), Err(ConfigError::BadBudget("0")));
        assert_eq!(
            parse("x.elf wall-budget=x"),
            Err(ConfigError::BadWallBudget("x"))
        );
        assert_eq!(
            parse("x.elf budget=5").unwrap().wall_budget,
            5 * WALL_PER_BUDGET
        );
        assert_eq!(parse("x.elf wall-budget=7").unwrap().wall_budget, 7);
        assert_eq!(
            parse("x.elf budget=18446744073709551615")
                .unwrap()
                .wall_budget,
            u64::MAX,
            "saturates"
        );
        assert_eq!(
            parse("x.elf target=kernel"),
            Err(ConfigError::BadTarget("kernel"))
        );
        assert_eq!(parse("x.elf initrd="), Err(ConfigError::BadInitrd));
        assert!(parse("vmlinuz apic=on").unwrap().apic);
        assert!(!parse("vmlinuz apic=off").unwrap().apic);
        assert!(!parse("vmlinuz").unwrap().apic);
        let c = parse("vmlinuz apic=emulated").unwrap();
        assert!(c.apic && !c.apic_virtualization);
        assert!(parse("vmlinuz apic=on").unwrap().apic_virtualization);
        assert!(!parse("vmlinuz apic=off").unwrap().apic_virtualization);
        assert_eq!(parse("vmlinuz apic=yes"), Err(ConfigError::BadApic("yes")));
        let c = parse("x.elf unwind=a.unwind,b quiet").unwrap();
        assert_eq!(c.unwind_modules().collect::<Vec<_>>(), ["a.unwind", "b"]);
        assert_eq!(guest_args(c.args).collect::<Vec<_>>(), ["quiet"]);
        assert_eq!(parse("x.elf").unwrap().unwind_modules().count(), 0);
        for bad in ["", "a,,b", "a,", "a,b,c,d,e"] {
            let line = format!("x.elf unwind={bad}");
            assert_eq!(
                parse(&line).map(|c| c.unwind),
                Err(ConfigError::BadUnwind(bad))
            );
        }
        assert_eq!(
            parse("x.elf task-offsets=1:2"),
            Err(ConfigError::BadTaskOffsets("1:2"))
        );
        assert_eq!(
            parse("x task-offsets=0x10:1:2:3").unwrap().task_offsets,
            hvprof_samplelog::TaskOffsets::parse("16:1:2:3")
        );
        let c =
            parse("vmlinuz vm=l mem=256M format=linux initrd=rd.gz console=ttyS0 quiet").unwrap();
        assert_eq!((c.format, c.initrd), (Format::Linux, Some("rd.gz")));
        assert_eq!(
            guest_args(c.args).collect::<Vec<_>>(),
            ["console=ttyS0", "quiet"]
        );
        assert_eq!(parse("x.elf pin=a"), Err(ConfigError::BadPin("a")));
        assert_eq!(parse("x.elf pin=0,,1"), Err(ConfigError::BadPin("0,,1")));
        assert_eq!(parse("x.elf pin=64"), Err(ConfigError::BadPin("64")));
        assert_eq!(
            parse("x.elf pin=0,1,2,3,4,5,6,7,0"),
            Err(ConfigError::BadPin("0,1,2,3,4,5,6,7,0"))
        );
        assert_eq!(
            parse("x.elf vcpus=2 pin=1"),
            Err(ConfigError::PinCount { pins: 1, vcpus: 2 })
        );
        assert!(
            parse("x.elf pin=0,1")
                .unwrap_err()
                .to_string()
                .contains("names 2 pCPUs but the VM has 1 vCPU")
        );
        let c = parse("x.elf vcpus=3 pin=1,0,1").unwrap();
        assert_eq!(c.pin.unwrap().as_slice(), &[1, 0, 1]);
        assert_eq!(c.pin.unwrap().get(2), Some(1));
        assert_eq!(parse("x.elf vcpus=2").unwrap().pin, None);
        assert!(
            parse("x.elf mem=3M")
                .unwrap_err()
                .to_string()
                .contains("multiple of 2 MiB")
        );
    }

    #[test]
    fn orc_layout_is_parsed_and_checked() {
        let l = "0xffffffff82000040:0xffffffff81000000:0xffffffff81e01ef2:0xffffffff8304c000:0xffffffff830af5ab:0xffffffff82c5d2e8:0xffffffff82dc42e0:368638:0xffffffff82fdead4:57376";
        let args = format!("linux.bzImage orc-layout={l} quiet");
        let c = parse(&args).unwrap();
        assert_eq!(c.orc_layout.map(|o| o.to_string()), Some(l.to_owned()));
        let args = format!("orc-layout={l} quiet");
        assert_eq!(guest_args(&args).collect::<Vec<_>>(), ["quiet"]);
        assert_eq!(
            parse("x orc-layout=0x1:2"),
            Err(ConfigError::BadOrcLayout("0x1:2"))
        );
        assert!(
            parse("x orc-layout=0x1:2")
                .unwrap_err()
                .to_string()
                .contains("manifest.json's orc_layout")
        );
    }

    #[test]
    fn mm_layout_is_parsed_and_checked() {
        let l = "72:0:8:16:32:120:128:24:24:36:40:2272:256:8:128:16:248:8:80:10:240:0";
        let args = format!("linux.bzImage mm-layout={l}");
        let c = parse(&args).unwrap();
        assert_eq!(c.mm_layout.map(|m| m.to_string()), Some(l.to_owned()));
        assert_eq!(
            parse("x mm-layout=1:2:3"),
            Err(ConfigError::BadMmLayout("1:2:3"))
        );
        let args = format!("mm-layout={l} quiet");
        assert_eq!(guest_args(&args).count(), 1);
    }

    proptest! {
        #[test]
        fn never_panics(s in "\\PC{0,80}") {
            let _ = parse(&s);
        }
    }
}
