//! What the hypervisor needs to name the running guest process: where `current` is and where
//! pid, tgid, comm and the page-table root sit in the kernel's structures.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::Error;
use crate::btf::Btf;
use crate::kallsyms::Kallsyms;

/// Offsets of the running task's identity, derived from the kernel's own BTF and kallsyms.
///
/// To read the current process on a vCPU: `task = *(u64 *)(gs_base + current_task)` where
/// `gs_base` is GS_BASE in kernel mode (CPL 0) and IA32_KERNEL_GS_BASE in user mode; then
/// `pid = *(i32 *)(task + pid)`, `comm = task + comm` (`comm_len` bytes, NUL-padded),
/// `mm = *(u64 *)(task + mm)` (0 for kernel threads), `pgd = *(u64 *)(mm + pgd)` (a kernel
/// virtual address: `__pa(pgd) == CR3 & !0x1fff` with KPTI).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskOffsets {
    /// Offset of the per-CPU `struct task_struct *` of the running task in each CPU's per-CPU
    /// area (the `current_task` symbol, or `pcpu_hot.current_task` on 6.2+ kernels).
    pub current_task: u64,
    /// `task_struct.pid` (i32).
    pub pid: u32,
    /// `task_struct.tgid` (i32).
    pub tgid: u32,
    /// `task_struct.comm` (char array).
    pub comm: u32,
    /// Its length (TASK_COMM_LEN, 16).
    pub comm_len: u32,
    /// `task_struct.mm` (pointer).
    pub mm: u32,
    /// `mm_struct.pgd` (pointer).
    pub pgd: u32,
}

impl TaskOffsets {
    /// Derives the offsets from a kernel's BTF and its symbols.
    pub fn derive(btf: &Btf<'_>, syms: &Kallsyms) -> Result<Self, Error> {
        let task = btf.struct_id("task_struct")?;
        let mm_struct = btf.struct_id("mm_struct")?;
        let member = |id: u32, st: &str, name: &str| {
            btf.member(id, name)?
                .ok_or_else(|| Error::Btf(format!("struct {st} has no member {name}")))
        };
        let comm = member(task, "task_struct", "comm")?;
        let comm_len = btf
            .array_len(comm.type_id)?
            .ok_or_else(|| Error::Btf("task_struct.comm is not an array".into()))?;
        let current_task = current_task(btf, syms)?;
        Ok(Self {
            current_task,
            pid: member(task, "task_struct", "pid")?.offset,
            tgid: member(task, "task_struct", "tgid")?.offset,
            comm: comm.offset,
            comm_len,
            mm: member(task, "task_struct", "mm")?.offset,
            pgd: member(mm_struct, "mm_struct", "pgd")?.offset,
        })
    }

    /// The compact one-token form for a command line:
    /// `current_task:0x1fbc0,pid:2416,tgid:2420,comm:2976,comm_len:16,mm:2272,pgd:72`.
    pub fn to_compact(&self) -> String {
        self.to_string()
    }
}

/// The per-CPU offset of the current task pointer: `current_task` (through 6.1), else the
/// `current_task` member of `pcpu_hot` (6.2+). Checked against BTF's `.data..percpu` section
/// when it lists the variable.
fn current_task(btf: &Btf<'_>, syms: &Kallsyms) -> Result<u64, Error> {
    let percpu = |name: &str| syms.percpu_symbols().iter().find(|s| s.name == name);
    let (address, btf_var) = if let Some(s) = percpu("current_task") {
        (s.address, btf.datasec_var(".data..percpu", "current_task")?)
    } else if let Some(s) = percpu("pcpu_hot") {
        let hot = btf.struct_id("pcpu_hot")?;
        let m = btf
            .member(hot, "current_task")?
            .ok_or_else(|| Error::Btf("struct pcpu_hot has no member current_task".into()))?;
        let var = btf.datasec_var(".data..percpu", "pcpu_hot")?;
        (
            s.address.wrapping_add(u64::from(m.offset)),
            var.map(|v| v.saturating_add(m.offset)),
        )
    } else {
        return Err(Error::Kallsyms(
            "no per-CPU symbol current_task or pcpu_hot (is CONFIG_SMP set and are the per-CPU symbols absolute?)".into(),
        ));
    };
    if let Some(v) = btf_var
        && u64::from(v) != address
    {
        return Err(Error::Btf(format!(
            "kallsyms puts current_task at per-CPU offset {address:#x}, BTF's .data..percpu at {v:#x}"
        )));
    }
    Ok(address)
}

impl fmt::Display for TaskOffsets {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "current_task:{:#x},pid:{},tgid:{},comm:{},comm_len:{},mm:{},pgd:{}",
            self.current_task, self.pid, self.tgid, self.comm, self.comm_len, self.mm, self.pgd
        )
    }
}

impl FromStr for TaskOffsets {
    type Err = Error;

    /// Parses the compact form; every field is required, in any order, decimal or 0x-hex.
    fn from_str(s: &str) -> Result<Self, Error> {
        let bad = |what: String| Error::Offsets(format!("{what} in \"{s}\""));
        let mut fields: [Option<u64>; 7] = [None; 7];
        const NAMES: [&str; 7] = [
            "current_task",
            "pid",
            "tgid",
            "comm",
            "comm_len",
            "mm",
            "pgd",
        ];
        for part in s.split(',') {
            let (key, value) = part
                .split_once(':')
                .ok_or_else(|| bad(format!("field \"{part}\" is not NAME:VALUE")))?;
            let i = NAMES
                .iter()
                .position(|n| *n == key)
                .ok_or_else(|| bad(format!("unknown field \"{key}\"")))?;
            let v = match value.strip_prefix("0x") {
                Some(hex) => u64::from_str_radix(hex, 16),
                None => value.parse(),
            }
            .map_err(|_| bad(format!("{key}: \"{value}\" is not a number")))?;
            if fields[i].replace(v).is_some() {
                return Err(bad(format!("{key} given twice")));
            }
        }
        let mut get = |i: usize| {
            fields[i]
                .take()
                .ok_or_else(|| bad(format!("{} missing", NAMES[i])))
        };
        let current_task = get(0)?;
        let mut small = |i: usize| {
            let v = get(i)?;
            u32::try_from(v).map_err(|_| bad(format!("{} {v} does not fit in 32 bits", NAMES[i])))
        };
        Ok(Self {
            current_task,
            pid: small(1)?,
            tgid: small(2)?,
            comm: small(3)?,
            comm_len: small(4)?,
            mm: small(5)?,
            pgd: small(6)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::btf::synth::Builder;
    use crate::kallsyms::synth::{Options, build};

    const BASE: u64 = 0xffff_ffff_8100_0000;

    fn kernel() -> (Vec<u8>, Kallsyms) {
        let mut b = Builder::new();
        let int = b.int("int", 4);
        let ch = b.int("char", 1);
        let comm = b.array(ch, int, 16);
        let pgd_anon = b.structure("", 80, &[("mmap_base", int, 0), ("pgd", int, 72 * 8)]);
        let mm = b.structure("mm_struct", 128, &[("", pgd_anon, 0)]);
        let pmm = b.ptr(mm);
        let task = b.structure(
            "task_struct",
            4096,
            &[
                ("mm", pmm, 2272 * 8),
                ("pid", int, 2416 * 8),
                ("tgid", int, 2420 * 8),
                ("comm", comm, 2976 * 8),
            ],
        );
        let pt = b.ptr(task);
        let v = b.var("current_task", pt);
        b.datasec(".data..percpu", &[(v, 0x1fbc0, 8)]);
        let syms = [
            (0x1fbc0, "Dcurrent_task"),
            (BASE, "T_text"),
            (BASE + 0x100, "Tentry_SYSCALL_64"),
        ];
        let data = build(
            &syms,
            BASE,
            0,
            Options {
                offsets_first: true,
                seqs: false,
            },
        );
        (b.finish(), Kallsyms::find(&data, 0).unwrap())
    }

    #[test]
    fn derives_offsets_and_round_trips_the_compact_form() {
        let (blob, syms) = kernel();
        let btf = Btf::parse(&blob).unwrap();
        let o = TaskOffsets::derive(&btf, &syms).unwrap();
        assert_eq!(
            o,
            TaskOffsets {
                current_task: 0x1fbc0,
                pid: 2416,
                tgid: 2420,
                comm: 2976,
                comm_len: 16,
                mm: 2272,
                pgd: 72,
            }
        );
        let text = o.to_compact();
        assert_eq!(
            text,
            "current_task:0x1fbc0,pid:2416,tgid:2420,comm:2976,comm_len:16,mm:2272,pgd:72"
        );
        assert_eq!(text.parse::<TaskOffsets>().unwrap(), o);
        let json = serde_json::to_string(&o).unwrap();
        assert_eq!(serde_json::from_str::<TaskOffsets>(&json).unwrap(), o);
    }

    #[test]
    fn compact_form_errors_name_the_field() {
        let e = |s: &str| s.parse::<TaskOffsets>().unwrap_err().to_string();
        assert!(e("pid:1").contains("current_task missing"));
        assert!(e("current_task:0x10,pid:x").contains("pid: \"x\" is not a number"));
        assert!(e("what:1").contains("unknown field \"what\""));
        assert!(e("pid:1,pid:2").contains("pid given twice"));
        let big = "current_task:1,pid:99999999999,tgid:1,comm:1,comm_len:1,mm:1,pgd:1";
        assert!(e(big).contains("does not fit"));
    }
}
