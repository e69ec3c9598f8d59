//! The sample model: what a pCPU was doing at a sample ([`What`]), a sample whole
//! ([`Sampled`]), its named frame ([`Frame`]), the distinct samples ([`Stack`]) with their counts
//! and call chains ([`Samples`]).
//!
//! A sample's frame is four names, outermost first: the VM, the process, the module, the
//! function. Guest samples: `guestOS1; cr3:0x1000 (or comm[tgid]); mix1.elf; work_a`.
//! Hypervisor samples: `[hypervisor]; <VM>: <exit reason> (or "no VM"); hvprof; <function>`.
//! Idle samples: `[idle]` alone.

use std::sync::Arc;

pub use hvprof_samplelog::ChainEnd;

use crate::model::chains::{RawChains, unpack_chains};
use crate::model::timeline::Owner;
use crate::naming::namer::{ProcessKey, exit_name};

/// What a pCPU was doing at a sample. (`Idle` stays last: a table by `What` has
/// `What::Idle as usize + 1` entries.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum What {
    GuestKernel,
    GuestUser,
    Hypervisor,
    Idle,
}

/// One sample, whole (made on the fly from its [`Slot`] and [`Stack`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sampled {
    pub tsc: u64,
    /// The guest CR3 (guest samples, and hypervisor samples with an exit-cause chain; 0 for
    /// the others).
    pub cr3: u64,
    /// The sampled address: guest RIP, or hypervisor RIP.
    pub addr: u64,
    /// Index into `Profile::frames`.
    pub frame: u32,
    /// Index into `Samples::stacks`.
    pub stack: u32,
    pub pcpu: u16,
    /// `NO_VM` for the hypervisor's work for no VM, and idle.
    pub vm: u16,
    pub vcpu: u16,
    /// The vCPU's last exit reason (`NO_EXIT` when none): hypervisor samples; 0 for the others.
    pub exit: u16,
    pub what: What,
}

impl Sampled {
    pub fn owner(&self) -> Owner {
        owner(self.what, self.vm, self.vcpu)
    }
}

/// Who a sample of `what` on `vm`'s `vcpu` belongs to on the common time axis.
pub(super) fn owner(what: What, vm: u16, vcpu: u16) -> Owner {
    match what {
        What::GuestKernel | What::GuestUser => Owner::Guest { vm, vcpu },
        What::Hypervisor => Owner::Hypervisor { vm, vcpu },
        What::Idle => Owner::Idle,
    }
}

/// A named frame: VM, process, module, function (outermost first).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Frame {
    pub what: What,
    pub vm: String,
    pub process: String,
    pub module: String,
    pub function: String,
    /// The guest process's identity, for labels (guest frames).
    pub process_key: Option<ProcessKey>,
}

impl Frame {
    /// A frame with no names (no memory of its own): a slot to be filled, or the base of one.
    pub(super) fn placeholder() -> Frame {
        Frame {
            what: What::Idle,
            vm: String::new(),
            process: String::new(),
            module: String::new(),
            function: String::new(),
            process_key: None,
        }
    }
}

/// The label of the hypervisor's "process" frame: whom it worked for, and on which exit.
pub fn hypervisor_label(vm_name: Option<&str>, exit: u16) -> String {
    match vm_name {
        None => "no VM".to_owned(),
        Some(name) => format!("{name}: {}", exit_name(exit)),
    }
}

impl Frame {
    /// The frame's names, outermost first, without the empty ones.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        [
            self.vm.as_str(),
            self.process.as_str(),
            self.module.as_str(),
            self.function.as_str(),
        ]
        .into_iter()
        .filter(|s| !s.is_empty())
    }

    /// The folded stack (`VM;process;module;function`), with `;` in names made `,` (Rust generic
    /// arrays `[u8; 4]` would split a frame).
    pub fn folded(&self) -> String {
        let mut out = String::new();
        for (i, n) in self.names().enumerate() {
            if i > 0 {
                out.push(';');
            }
            // One string, not one per name (a flame graph folds every frame).
            for (j, part) in n.split(';').enumerate() {
                if j > 0 {
                    out.push(',');
                }
                out.push_str(part);
            }
        }
        out
    }
}

/// A distinct sample, all but its time: what every view reads from a sample. Samples with
/// equal fields share one `Stack`, and the profile keeps each sample as its TSC and the index
/// of its stack ([`Slot`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stack {
    pub what: What,
    pub pcpu: u16,
    pub vm: u16,
    pub vcpu: u16,
    /// Hypervisor samples: the vCPU's last exit reason (`NO_EXIT` when none); 0 for the others.
    pub exit: u16,
    /// The sampled address: guest RIP, or hypervisor RIP.
    pub addr: u64,
    /// Guest samples, and hypervisor samples with an exit-cause chain: the guest CR3; 0 for
    /// the others.
    pub cr3: u64,
    /// The guest process (guest samples, and hypervisor samples with an exit-cause chain): its
    /// task where the log names it, else its CR3.
    pub process: Option<ProcessKey>,
    /// Index into `Profile::frames`.
    pub frame: u32,
    /// A hypervisor sample taken while the hypervisor handled a vCPU's exit, whose guest chain
    /// was walked: the guest code path at that exit (the exit's RIP, then its callers).
    pub exit_cause: bool,
    /// Its call chains as the capture gives them: see [`Samples::chain`] (0: none).
    pub chain: u32,
    /// Its call chains named: index into `Profile::calls.stacks` (0: none, or not named).
    pub calls: u32,
    /// Samples of this stack.
    pub count: u64,
}

/// A capture's distinct samples ([`Stack`]s, each with its count), how many samples there are
/// and the TSC of the first and last. Memory grows with the distinct stacks, not the samples;
/// the samples themselves are read again, in TSC order, by [`crate::model::profile::Profile::replay`].
#[derive(Debug, Default)]
pub struct Samples {
    pub(super) stacks: Vec<Stack>,
    /// The distinct call chains, packed (see [`pack_chains`]); `chains[i]` is chain `i + 1`.
    pub(super) chains: Vec<Arc<[u64]>>,
    pub(super) len: usize,
    /// (first, last) sample TSC; (0, 0) without samples.
    pub(super) span: (u64, u64),
}

impl Samples {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The distinct stacks, each with its count.
    pub fn stacks(&self) -> &[Stack] {
        &self.stacks
    }

    /// The call chains `Stack::chain` numbers (`None` for 0, a sample without chains).
    pub fn chain(&self, id: u32) -> Option<RawChains<'_>> {
        let i = (id as usize).checked_sub(1)?;
        self.chains.get(i).map(|c| unpack_chains(c))
    }

    /// Whether any sample has call chains.
    pub fn has_chains(&self) -> bool {
        !self.chains.is_empty()
    }

    /// First and last sample TSC (0, 0 without samples).
    pub fn span(&self) -> (u64, u64) {
        self.span
    }

    /// A sample whole, from its TSC and stack.
    pub fn sampled(&self, tsc: u64, stack: u32) -> Sampled {
        let s = &self.stacks[stack as usize];
        Sampled {
            tsc,
            cr3: s.cr3,
            addr: s.addr,
            frame: s.frame,
            stack,
            pcpu: s.pcpu,
            vm: s.vm,
            vcpu: s.vcpu,
            exit: s.exit,
            what: s.what,
        }
    }
}

pub(crate) fn is_guest(what: What) -> bool {
    matches!(what, What::GuestKernel | What::GuestUser)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn folded_frames_never_split_on_semicolons() {
        let f = Frame {
            what: What::Hypervisor,
            vm: "[hypervisor]".into(),
            process: "no VM".into(),
            module: "hvprof".into(),
            function: "<[u8; 4] as Foo>::bar".into(),
            process_key: None,
        };
        assert_eq!(
            f.folded(),
            "[hypervisor];no VM;hvprof;<[u8, 4] as Foo>::bar"
        );
        let idle = Frame {
            what: What::Idle,
            vm: String::new(),
            process: String::new(),
            module: String::new(),
            function: "[idle]".into(),
            process_key: None,
        };
        assert_eq!(idle.folded(), "[idle]");
    }
}
