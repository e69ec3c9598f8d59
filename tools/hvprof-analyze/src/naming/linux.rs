//! Linux guests: their kernel's functions and their processes, with no agent in the guest.
//!
//! - Kernel symbols come from the guest's decompressed vmlinux (`--kernel`), rebuilt from its
//!   kallsyms tables by `linux-guest`; the KASLR slide from the guest's IA32_LSTAR, which the
//!   hypervisor sends in the VM's end frame when it stops (`entry_SYSCALL_64` moves with the
//!   kernel).
//!   Kernel frames go under the module `[guest.kallsyms]`.
//! - Processes come from the task frames: the hypervisor reads the task a vCPU runs at each
//!   sample and logs it when it changes, so a sample at TSC `t` on a vCPU belongs to the vCPU's
//!   last task frame at or before `t` (a CR3 or task structure reused by a later process is a
//!   new frame, not the old name).

use rustc_hash::FxHashMap as HashMap;

use hvprof_samplelog::{Task, VmEnd};
use linux_guest::KernelImage;

/// The module kernel frames are reported under (viewers mark `[...]` modules as kernel).
pub const KERNEL_MODULE: &str = "[guest.kallsyms]";

/// A guest kernel and where it runs.
pub struct GuestKernel {
    pub image: KernelImage,
    /// Runtime address minus link address.
    pub slide: u64,
}

impl GuestKernel {
    /// The function at a runtime kernel address.
    pub fn function(&self, rip: u64) -> Option<&str> {
        self.function_offset(rip).map(|(name, _)| name)
    }

    /// The function at a runtime kernel address, and the address's offset from its start.
    pub fn function_offset(&self, rip: u64) -> Option<(&str, u64)> {
        self.image
            .lookup(rip, self.slide)
            .map(|h| (h.symbol.name.as_str(), h.offset))
    }
}

/// Each VM's IA32_LSTAR from its VM end frame (the last one, when it is non-zero): VM id →
/// LSTAR. Console text is never read for it.
pub fn lstars(vm_ends: &[VmEnd]) -> HashMap<u16, u64> {
    let mut out = HashMap::default();
    for v in vm_ends {
        if v.lstar != 0 {
            out.insert(v.vm, v.lstar);
        } else {
            out.remove(&v.vm);
        }
    }
    out
}

/// Kernel-mode code below the kernel half runs before the kernel maps itself: the bzImage's
/// decompressor and the kernel's first instructions, at physical addresses.
pub const EARLY_BOOT: &str = "[early boot: decompressor, identity-mapped]";
const KERNEL_HALF: u64 = 0xffff_8000_0000_0000;

/// The kernel-mode function name of `rip` in a VM with `kernel` (if known).
pub fn kernel_function(kernel: Option<&GuestKernel>, rip: u64) -> String {
    kernel_symbol(kernel, rip).0
}

/// [`kernel_function`] with the address's offset from the function's start (`None` when it is
/// not named).
pub fn kernel_symbol(kernel: Option<&GuestKernel>, rip: u64) -> (String, Option<u64>) {
    if rip < KERNEL_HALF {
        return (EARLY_BOOT.to_owned(), None);
    }
    kernel.and_then(|k| k.function_offset(rip)).map_or_else(
        || (format!("[unknown] {rip:#x}"), None),
        |(name, off)| (name.to_owned(), Some(off)),
    )
}

/// Whether `addr` is in the kernel's half of a 64-bit address space (a Linux guest's kernel
/// code; user code is in the lower half).
pub const fn is_kernel_address(addr: u64) -> bool {
    addr >= KERNEL_HALF
}

/// A process as the report names it: `comm[tgid]`, the pid when it differs (a thread).
pub fn process_label(t: &Task) -> String {
    if t.pid == t.tgid {
        format!(
            "{}[{}]",
            crate::naming::escape::printable(t.comm.as_str()),
            t.tgid
        )
    } else {
        format!(
            "{}[{}/{}]",
            crate::naming::escape::printable(t.comm.as_str()),
            t.tgid,
            t.pid
        )
    }
}

/// Each vCPU's task changes in TSC order, to find the task of a sample.
#[derive(Clone, Default)]
pub struct TaskTimeline {
    per_vcpu: HashMap<(u16, u16), Vec<(u64, usize)>>,
    labels: Vec<String>,
    index: HashMap<String, usize>,
}

impl TaskTimeline {
    pub fn new(tasks: &[Task]) -> Self {
        let mut t = TaskTimeline::default();
        for task in tasks {
            let id = t.label_id(task);
            t.per_vcpu
                .entry((task.vm, task.vcpu))
                .or_default()
                .push((task.tsc, id));
        }
        for list in t.per_vcpu.values_mut() {
            list.sort_by_key(|&(tsc, _)| tsc);
        }
        t
    }

    /// The number of a task's label, numbered in the order first seen.
    fn label_id(&mut self, task: &Task) -> usize {
        let label = process_label(task);
        match self.index.get(&label) {
            Some(&i) => i,
            None => {
                self.labels.push(label.clone());
                self.index.insert(label, self.labels.len() - 1);
                self.labels.len() - 1
            }
        }
    }

    /// Adds a task frame that arrives after the others (a live stream's), as [`TaskTimeline::new`]
    /// would have placed it: after its vCPU's frames at or before its TSC.
    pub fn push(&mut self, task: &Task) {
        let id = self.label_id(task);
        let list = self.per_vcpu.entry((task.vm, task.vcpu)).or_default();
        // Task frames mostly arrive in TSC order: searched from the back.
        let at = list
            .iter()
            .rposition(|&(t, _)| t <= task.tsc)
            .map_or(0, |i| i + 1);
        list.insert(at, (task.tsc, id));
    }

    /// Forgets each vCPU's task changes that no sample at or after `tsc` falls in: those
    /// before its last one at or before `tsc` (the labels stay, with their numbers).
    pub fn forget_before(&mut self, tsc: u64) {
        for list in self.per_vcpu.values_mut() {
            let n = list.partition_point(|&(t, _)| t <= tsc);
            list.drain(..n.saturating_sub(1));
        }
    }

    /// The task vCPU `vcpu` of VM `vm` ran at `tsc` (`None` before its first task frame).
    pub fn task_at(&self, vm: u16, vcpu: u16, tsc: u64) -> Option<&str> {
        self.task_index_at(vm, vcpu, tsc).map(|i| self.label(i))
    }

    /// The index of the task `task_at` names (its label is `label(index)`).
    pub fn task_index_at(&self, vm: u16, vcpu: u16, tsc: u64) -> Option<usize> {
        self.task_span_at(vm, vcpu, tsc).0
    }

    /// [`TaskTimeline::task_index_at`], with the stretch of time its answer holds for: from
    /// (the vCPU's task frame before `tsc`, or 0) to (its next task frame; none after the last).
    pub fn task_span_at(&self, vm: u16, vcpu: u16, tsc: u64) -> (Option<usize>, u64, Option<u64>) {
        let Some(list) = self.per_vcpu.get(&(vm, vcpu)) else {
            return (None, 0, None);
        };
        let n = list.partition_point(|&(t, _)| t <= tsc);
        let to = list.get(n).map(|&(t, _)| t);
        match n.checked_sub(1).map(|i| list[i]) {
            Some((from, id)) => (Some(id), from, to),
            None => (None, 0, to),
        }
    }

    /// A task's label (`comm[tgid]`), by its index.
    pub fn label(&self, index: usize) -> &str {
        self.labels.get(index).map_or("", String::as_str)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hvprof_samplelog::FixedStr;

    fn task(tsc: u64, vcpu: u16, pid: u32, tgid: u32, comm: &str) -> Task {
        Task {
            tsc,
            vm: 0,
            vcpu,
            pid,
            tgid,
            cr3: 0x1000,
            comm: FixedStr::truncated(comm),
            ..Task::default()
        }
    }

    #[test]
    fn samples_take_the_last_task_at_or_before_them() {
        // The same CR3 and task structure reused by a later process: still a new name.
        let tasks = [
            task(100, 0, 1, 1, "init"),
            task(500, 0, 57, 57, "w41"),
            task(900, 0, 58, 58, "sh"),
            task(300, 1, 60, 57, "w41"),
        ];
        let t = TaskTimeline::new(&tasks);
        assert_eq!(t.task_at(0, 0, 99), None);
        assert_eq!(t.task_at(0, 0, 100), Some("init[1]"));
        assert_eq!(t.task_at(0, 0, 899), Some("w41[57]"));
        assert_eq!(t.task_at(0, 0, 5000), Some("sh[58]"));
        assert_eq!(t.task_at(0, 1, 400), Some("w41[57/60]"));
        assert_eq!(t.task_at(1, 0, 400), None);
        // Pushed one by one as a stream brings them (one out of TSC order), the same answers.
        let mut pushed = TaskTimeline::default();
        for task in [tasks[1], tasks[0], tasks[2], tasks[3]] {
            pushed.push(&task);
        }
        for (vcpu, tsc) in [
            (0, 99),
            (0, 100),
            (0, 499),
            (0, 500),
            (0, 5000),
            (1, 299),
            (1, 300),
        ] {
            assert_eq!(pushed.task_at(0, vcpu, tsc), t.task_at(0, vcpu, tsc));
        }
        // What no sample from TSC 600 on falls in is forgotten; the rest stays.
        pushed.forget_before(600);
        assert_eq!(pushed.per_vcpu[&(0, 0)], [(500, 0), (900, 2)]);
        assert_eq!(pushed.task_at(0, 0, 600), Some("w41[57]"));
        assert_eq!(pushed.task_at(0, 0, 5000), Some("sh[58]"));
        assert_eq!(pushed.task_at(0, 1, 600), Some("w41[57/60]"));
    }

    #[test]
    fn lstar_comes_from_the_last_vm_end_frame() {
        let end = |vm, lstar| VmEnd {
            vm,
            lstar,
            ..VmEnd::default()
        };
        let m = lstars(&[
            end(0, 0xffff_ffff_9a20_0080),
            end(1, 0xbad),
            end(1, 0xffff_ffff_8100_0000),
            end(2, 0x1234),
            end(2, 0),
        ]);
        assert_eq!(m.get(&0), Some(&0xffff_ffff_9a20_0080));
        assert_eq!(m.get(&1), Some(&0xffff_ffff_8100_0000));
        assert_eq!(
            m.get(&2),
            None,
            "a VM whose last frame has no LSTAR has none"
        );
    }
}
