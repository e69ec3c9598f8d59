//! Where a sample is classified, once, as it is decoded: what it is (guest kernel, guest user,
//! hypervisor, idle), the address that names it, its pCPU, VM, vCPU and last exit, and for a
//! guest sample who ran (a Linux guest's task at the sample's time, else its address space): the
//! [`Key`] its stack is counted by. The first pass and the replay classify with the same
//! function.

use hvprof_samplelog::{Chain, NO_VM, Sample, SampleKind};

use crate::model::samples::{What, is_guest};
use crate::naming::namer::{ProcessKey, Processes, TaskMemo};

/// A sample classified, before naming: the fields of [`Stack`] the records give, and its
/// process (guest samples).
/// A hypervisor sample whose key has a process is an exit cause (see [`exit_cause`]). Its
/// chains' number is beside it (in `KeyCounts`, `StackIndex::ids`); its context is the key
/// without its address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Key {
    pub(super) addr: u64,
    pub(super) cr3: u64,
    pub(super) process: Option<ProcessKey>,
    pub(super) pcpu: u16,
    pub(super) vm: u16,
    pub(super) vcpu: u16,
    pub(super) exit: u16,
    pub(super) what: What,
}

/// Every field, as four words: a context is looked up for about one sample in six (the
/// derived hash wrote each field on its own, nine writes).
impl std::hash::Hash for Key {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        let (tag, process) = match self.process {
            None => (0, 0),
            Some(ProcessKey::Task(t)) => (1, u64::from(t)),
            Some(ProcessKey::Cr3(c)) => (2, c),
        };
        h.write_u64(self.addr);
        h.write_u64(self.cr3 ^ process.rotate_left(32));
        h.write_u64(
            u64::from(self.pcpu)
                | u64::from(self.vm) << 16
                | u64::from(self.vcpu) << 32
                | u64::from(self.exit) << 48,
        );
        h.write_u64(tag | (self.what as u64) << 8);
    }
}

impl Key {
    /// The key without its address.
    #[inline]
    pub(super) fn context(&self) -> Key {
        Key { addr: 0, ..*self }
    }

    /// Whether it is a hypervisor sample's on a vCPU's exit, with the exit's guest chain.
    pub(super) fn exit_cause(&self) -> bool {
        self.what == What::Hypervisor && self.process.is_some()
    }
}

/// The one classification of a sample: what it is, which address names it, and (guest
/// samples) who ran: with `processes`, a Linux guest's task at the sample's time. A sample
/// with chains has more: see [`exit_cause`].
///
/// Always inlined: called, it returns the key through memory, which the caller then reads
/// back in other widths (its context, the comparison with the last one), a store-forwarding
/// stall per sample (about 6 % of the first pass on 10 M samples).
#[inline(always)]
pub(super) fn classify(
    pcpu: u16,
    s: &Sample,
    processes: Option<&Processes>,
    memo: &mut TaskMemo,
) -> Key {
    let (what, addr) = match s.kind {
        SampleKind::Guest if s.cpl() == 3 => (What::GuestUser, s.guest_rip),
        SampleKind::Guest => (What::GuestKernel, s.guest_rip),
        SampleKind::Hypervisor => (What::Hypervisor, s.host_rip),
        SampleKind::Idle => (What::Idle, s.host_rip),
    };
    let guest = is_guest(what);
    let process = guest.then(|| process(s, processes, memo));
    Key {
        addr,
        cr3: if guest { s.guest_cr3 } else { 0 },
        process,
        pcpu,
        vm: s.vm,
        vcpu: s.vcpu,
        exit: if what == What::Hypervisor {
            s.exit_reason
        } else {
            0
        },
        what,
    }
}

/// Who ran in the guest at a sample.
#[inline]
fn process(s: &Sample, processes: Option<&Processes>, memo: &mut TaskMemo) -> ProcessKey {
    match processes {
        Some(p) => p.key_memo(memo, s.vm, s.vcpu, s.tsc, s.guest_cr3),
        None => ProcessKey::Cr3(s.guest_cr3),
    }
}

/// A sample with chains of kind `what` is an exit cause when it is the hypervisor's on a
/// vCPU's exit and that vCPU's guest chain was walked: its key gets the guest context that
/// names that chain, the guest CR3 and process (returned).
#[inline]
pub(super) fn exit_cause(
    what: What,
    s: &Sample,
    processes: Option<&Processes>,
    memo: &mut TaskMemo,
) -> Option<(u64, ProcessKey)> {
    (what == What::Hypervisor && s.vm != NO_VM && s.guest_chain != Chain::NOT_WALKED)
        .then(|| (s.guest_cr3, process(s, processes, memo)))
}
