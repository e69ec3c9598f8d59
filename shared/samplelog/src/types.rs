//! The data carried by the log. One set of definitions for both sides: the hypervisor fills these
//! (no allocation: strings and tables are fixed-capacity arrays), the host decodes into them.

use core::fmt;
use core::ops::Deref;

/// Current format version, written in the header frame.
pub const FORMAT_VERSION: u16 = 3;
/// `Sample::vm` / `Event::vm` when no VM is concerned (idle, hypervisor work for no VM).
pub const NO_VM: u16 = 0xffff;
/// `Sample::vcpu` when no vCPU is concerned.
pub const NO_VCPU: u16 = 0xffff;
/// `Sample::exit_reason` before the vCPU's first VM exit (and for idle samples).
pub const NO_EXIT: u16 = 0xffff;
/// Most VMs a header can describe.
pub const MAX_VMS: usize = 64;
/// Capacity of `VmInfo::name`.
pub const VM_NAME_LEN: usize = 32;
/// Capacity of `VmInfo::image`.
pub const IMAGE_NAME_LEN: usize = 64;
/// Capacity of a `BuildId` (a GNU build id is a 20-byte SHA-1).
pub const BUILD_ID_LEN: usize = 20;

/// `Header::source`: the per-pCPU deadline clock (VMX-preemption timer in the guest, LAPIC timer
/// in the hypervisor and idle).
pub const SOURCE_DEADLINE: u8 = 0;
/// `Header::source`: the architectural PMU (e.g. `CPU_CLK_UNHALTED.REF`) overflowing into an NMI.
pub const SOURCE_PMU: u8 = 1;

/// `Sample::guest_mode` bits 3:2.
pub const MODE_REAL: u8 = 0;
/// `Sample::guest_mode` bits 3:2: protected mode, 16- or 32-bit code.
pub const MODE_PROTECTED: u8 = 1;
/// `Sample::guest_mode` bits 3:2: IA-32e mode, 64-bit code.
pub const MODE_LONG: u8 = 2;

/// Packs a CPL (0..=3) and a `MODE_*` value into `Sample::guest_mode`.
#[must_use]
pub const fn guest_mode(cpl: u8, mode: u8) -> u8 {
    (cpl & 3) | ((mode & 3) << 2)
}

/// What the sampled pCPU was doing.
#[repr(u8)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SampleKind {
    /// Running guest code (the guest fields are the interrupted guest state).
    #[default]
    Guest = 0,
    /// Running the hypervisor (`host_rip`); `vm`/`vcpu` name the vCPU whose exit was being handled
    /// or are `NO_VM`/`NO_VCPU`.
    Hypervisor = 1,
    /// In the idle loop.
    Idle = 2,
}

impl SampleKind {
    /// The kind with this wire value.
    #[must_use]
    pub const fn from_u8(v: u8) -> Option<Self> {
        match v {
            0 => Some(Self::Guest),
            1 => Some(Self::Hypervisor),
            2 => Some(Self::Idle),
            _ => None,
        }
    }
}

/// One sample, as taken by the sample path of one pCPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Sample {
    /// Host TSC when the sample was taken.
    pub tsc: u64,
    /// Guest, hypervisor or idle.
    pub kind: SampleKind,
    /// VM index (see `Header::vms`), or `NO_VM`.
    pub vm: u16,
    /// vCPU index within the VM, or `NO_VCPU`.
    pub vcpu: u16,
    /// The vCPU's VPID.
    pub vpid: u16,
    /// Guest RIP (from the VMCS or the interrupted guest state).
    pub guest_rip: u64,
    /// Guest CR3: the guest process (at a hypervisor sample with an exit-cause guest chain, the
    /// vCPU's at that exit; else 0 there).
    pub guest_cr3: u64,
    /// Bits 1:0 CPL; bits 3:2 `MODE_*`. See [`guest_mode`].
    pub guest_mode: u8,
    /// Basic reason of this vCPU's last VM exit, or `NO_EXIT`.
    pub exit_reason: u16,
    /// Hypervisor RIP when `kind` is `Hypervisor` (or the idle loop's for `Idle`); 0 otherwise.
    pub host_rip: u64,
    /// TSC ticks the sample path itself took.
    pub cost: u32,
    /// The hypervisor's call chain at a hypervisor or idle sample (the callers of `host_rip`).
    /// Its frames travel beside the records (see [`Chains`]).
    pub host_chain: Chain,
    /// The guest's call chain: at a guest sample the callers of `guest_rip`; at a hypervisor
    /// sample taken while it handled a vCPU's exit, the guest RIP at that exit then its callers
    /// (the guest code path that cost the hypervisor this time).
    pub guest_chain: Chain,
}

/// Most frames one call chain carries.
pub const MAX_CHAIN_DEPTH: usize = 32;

/// How a call chain ends (`Chain::end`).
#[repr(u8)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ChainEnd {
    /// The walk reached the outermost frame (a zero frame pointer or return address).
    Complete = 0,
    /// Cut at the walker's depth limit: outer callers are missing.
    DepthLimit = 1,
    /// A frame failed a check (a frame pointer that does not climb the stack, is misaligned,
    /// unmapped, or outside the VM or the hypervisor's stack): the frames before it are kept.
    BadFrame = 2,
    /// No chain was taken for this sample (none asked for, or no unwinder for its mode).
    #[default]
    NotWalked = 3,
}

impl ChainEnd {
    /// The end with this wire value (0..=3).
    #[must_use]
    pub const fn from_u8(v: u8) -> Self {
        match v & 3 {
            0 => Self::Complete,
            1 => Self::DepthLimit,
            2 => Self::BadFrame,
            _ => Self::NotWalked,
        }
    }
}

/// The shape of one call chain of a sample: how many frames (0..=`MAX_CHAIN_DEPTH`) and how it
/// ended. Packed in a byte: bits 5:0 depth, bits 7:6 the [`ChainEnd`].
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Chain(u8);

impl Chain {
    /// No chain taken.
    pub const NOT_WALKED: Chain = Chain((ChainEnd::NotWalked as u8) << 6);

    /// `depth` frames (clamped to `MAX_CHAIN_DEPTH`) ending as `end`.
    #[must_use]
    pub const fn new(depth: usize, end: ChainEnd) -> Self {
        let d = if depth > MAX_CHAIN_DEPTH {
            MAX_CHAIN_DEPTH
        } else {
            depth
        };
        // d <= 32 fits bits 5:0.
        #[allow(clippy::cast_possible_truncation)]
        let d = d as u8;
        Chain(d | (end as u8) << 6)
    }

    /// Its frames.
    #[must_use]
    pub const fn depth(self) -> usize {
        (self.0 & 0x3f) as usize
    }

    /// How it ended.
    #[must_use]
    pub const fn end(self) -> ChainEnd {
        ChainEnd::from_u8(self.0 >> 6)
    }

    /// Whether the chain was cut (depth limit or a bad frame).
    #[must_use]
    pub const fn truncated(self) -> bool {
        matches!(self.end(), ChainEnd::DepthLimit | ChainEnd::BadFrame)
    }
}

impl Default for Chain {
    fn default() -> Self {
        Self::NOT_WALKED
    }
}

impl fmt::Debug for Chain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Chain({}, {:?})", self.depth(), self.end())
    }
}

/// The frames of one sample's two chains, borrowed from a block's frame list.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Chains<'a> {
    /// The hypervisor's frames, innermost first (`Sample::host_chain`).
    pub host: &'a [u64],
    /// The guest's frames, innermost first (`Sample::guest_chain`).
    pub guest: &'a [u64],
}

/// Frames the samples among `records` carry (each sample's host then guest chain).
#[must_use]
pub fn chain_frames(records: &[Record]) -> usize {
    records.iter().map(Record::chain_frames).sum()
}

/// Walks `records` with the frames of each sample's chains. `frames` is the block's frame list:
/// every sample's host chain then guest chain, in record order (as the decoder gives it and the
/// encoder takes it). A list shorter than the records need gives empty chains from where it
/// runs out.
pub fn with_chains<'a>(
    records: &'a [Record],
    frames: &'a [u64],
) -> impl Iterator<Item = (&'a Record, Chains<'a>)> + 'a {
    let mut at = 0usize;
    records.iter().map(move |r| {
        let chains = match r {
            Record::Sample(s) => {
                let mut take = |n: usize| {
                    let from = at.min(frames.len());
                    let to = at.saturating_add(n).min(frames.len());
                    at = at.saturating_add(n);
                    &frames[from..to]
                };
                let host = take(s.host_chain.depth());
                let guest = take(s.guest_chain.depth());
                Chains { host, guest }
            }
            Record::Event(_) => Chains::default(),
        };
        (r, chains)
    })
}

impl Sample {
    /// Frames its two call chains carry (what follows it in a block's frame list).
    #[must_use]
    pub const fn chain_frames(&self) -> usize {
        self.host_chain.depth() + self.guest_chain.depth()
    }

    /// Guest CPL (bits 1:0 of `guest_mode`).
    #[must_use]
    pub const fn cpl(&self) -> u8 {
        self.guest_mode & 3
    }

    /// Guest execution mode (`MODE_*`, bits 3:2 of `guest_mode`).
    #[must_use]
    pub const fn cpu_mode(&self) -> u8 {
        (self.guest_mode >> 2) & 3
    }
}

/// Scheduling event kind.
#[repr(u8)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum EventKind {
    /// The vCPU starts running on this pCPU.
    #[default]
    VcpuIn = 0,
    /// The vCPU stops running on this pCPU (`Event::reason` says why).
    VcpuOut = 1,
}

/// Why a vCPU stopped running (meaningful for `VcpuOut`; carried as is for `VcpuIn`).
#[repr(u8)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum OutReason {
    /// Its time slice ended while it was runnable: the time until it runs again is steal.
    #[default]
    Preempted = 0,
    /// It executed HLT (or is otherwise waiting): the time until it runs again is halt.
    Halted = 1,
    /// The VM was stopped (shut down, faulted, or the run ended).
    Stopped = 2,
    /// It gave up the CPU voluntarily (PAUSE-loop exit and the like) while runnable.
    Yielded = 3,
}

impl OutReason {
    /// The reason with this wire value (0..=3).
    #[must_use]
    pub const fn from_u8(v: u8) -> Option<Self> {
        match v {
            0 => Some(Self::Preempted),
            1 => Some(Self::Halted),
            2 => Some(Self::Stopped),
            3 => Some(Self::Yielded),
            _ => None,
        }
    }
}

/// A scheduling event on one pCPU, for the steal/halt analysis.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Event {
    /// Host TSC of the event.
    pub tsc: u64,
    /// In or out.
    pub kind: EventKind,
    /// The VM of the vCPU.
    pub vm: u16,
    /// The vCPU within the VM.
    pub vcpu: u16,
    /// Why it went out (for `VcpuOut`).
    pub reason: OutReason,
}

/// Where a guest program's bytes went (an output frame's stream).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u8)]
pub enum OutputStream {
    /// Its standard output.
    #[default]
    Stdout = 1,
    /// Its standard error.
    Stderr = 2,
    /// Neither: the frame counts bytes the hypervisor could not keep (`Output::lost`).
    Lost = 3,
}

impl OutputStream {
    /// The stream with this wire value (1..=3).
    #[must_use]
    pub const fn from_u8(v: u8) -> Option<Self> {
        match v {
            1 => Some(Self::Stdout),
            2 => Some(Self::Stderr),
            3 => Some(Self::Lost),
            _ => None,
        }
    }
}

/// Bytes a program in a guest wrote to its stdout or stderr and gave the hypervisor whole (its
/// output channel, docs/GUEST-ABI.md), in the order it wrote them; or how many it could not keep.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Output<'a> {
    /// The VM.
    pub vm: u16,
    /// Stdout, stderr, or `Lost`.
    pub stream: OutputStream,
    /// With `OutputStream::Lost`: bytes written that the hypervisor had no room for (else 0).
    pub lost: u64,
    /// The bytes (empty with `OutputStream::Lost`).
    pub bytes: &'a [u8],
}

/// One entry of a pCPU's record stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Record {
    /// A sample.
    Sample(Sample),
    /// A scheduling event.
    Event(Event),
}

impl Record {
    /// The record's host TSC.
    #[must_use]
    pub const fn tsc(&self) -> u64 {
        match self {
            Record::Sample(s) => s.tsc,
            Record::Event(e) => e.tsc,
        }
    }

    /// The sample, if this is one.
    #[must_use]
    pub const fn as_sample(&self) -> Option<&Sample> {
        match self {
            Record::Sample(s) => Some(s),
            Record::Event(_) => None,
        }
    }

    /// Frames its call chains carry (none for an event).
    #[must_use]
    pub const fn chain_frames(&self) -> usize {
        match self {
            Record::Sample(s) => s.chain_frames(),
            Record::Event(_) => 0,
        }
    }

    /// The event, if this is one.
    #[must_use]
    pub const fn as_event(&self) -> Option<&Event> {
        match self {
            Record::Event(e) => Some(e),
            Record::Sample(_) => None,
        }
    }
}

impl From<Sample> for Record {
    fn from(s: Sample) -> Self {
        Record::Sample(s)
    }
}

impl From<Event> for Record {
    fn from(e: Event) -> Self {
        Record::Event(e)
    }
}

/// A value did not fit a fixed-capacity field.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CapacityError {
    /// The field's capacity in bytes (or entries).
    pub capacity: usize,
}

impl fmt::Display for CapacityError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "value exceeds the capacity of {}", self.capacity)
    }
}

impl core::error::Error for CapacityError {}

/// A UTF-8 string of at most `N` bytes (`N` ≤ 255), stored inline.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct FixedStr<const N: usize> {
    len: u8,
    buf: [u8; N],
}

impl<const N: usize> FixedStr<N> {
    const CAPACITY_OK: () = assert!(N <= 255, "FixedStr capacity must fit a u8 length");

    /// The empty string.
    #[must_use]
    pub const fn new() -> Self {
        let () = Self::CAPACITY_OK;
        Self {
            len: 0,
            buf: [0; N],
        }
    }

    /// `s`, or an error if it is longer than `N` bytes.
    ///
    /// # Errors
    /// `CapacityError` when `s.len() > N`.
    pub fn try_from_str(s: &str) -> Result<Self, CapacityError> {
        if s.len() > N {
            return Err(CapacityError { capacity: N });
        }
        let mut out = Self::new();
        out.buf[..s.len()].copy_from_slice(s.as_bytes());
        // `s.len() <= N <= 255`.
        out.len = u8::try_from(s.len()).unwrap_or(u8::MAX);
        Ok(out)
    }

    /// The longest prefix of `s` that fits, cut at a character boundary.
    #[must_use]
    pub fn truncated(s: &str) -> Self {
        let mut end = s.len().min(N);
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        Self::try_from_str(&s[..end]).unwrap_or_default()
    }

    /// The string.
    #[must_use]
    pub fn as_str(&self) -> &str {
        // Built only from `&str` prefixes cut at character boundaries (or validated bytes).
        core::str::from_utf8(&self.buf[..usize::from(self.len)]).unwrap_or("")
    }

    /// Length in bytes.
    #[must_use]
    pub const fn len(&self) -> usize {
        self.len as usize
    }

    /// Whether the string is empty.
    #[must_use]
    pub const fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// From raw bytes that must be UTF-8 (decoder side).
    #[cfg(feature = "std")]
    pub(crate) fn from_utf8(bytes: &[u8]) -> Option<Self> {
        let s = core::str::from_utf8(bytes).ok()?;
        Self::try_from_str(s).ok()
    }
}

impl<const N: usize> Default for FixedStr<N> {
    fn default() -> Self {
        Self::new()
    }
}

impl<const N: usize> Deref for FixedStr<N> {
    type Target = str;
    fn deref(&self) -> &str {
        self.as_str()
    }
}

impl<const N: usize> fmt::Debug for FixedStr<N> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl<const N: usize> fmt::Display for FixedStr<N> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl<const N: usize> TryFrom<&str> for FixedStr<N> {
    type Error = CapacityError;
    fn try_from(s: &str) -> Result<Self, CapacityError> {
        Self::try_from_str(s)
    }
}

/// A GNU build id of 0..=20 bytes (0 = none), stored inline.
#[derive(Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct BuildId {
    len: u8,
    bytes: [u8; BUILD_ID_LEN],
}

impl BuildId {
    /// No build id.
    pub const NONE: BuildId = BuildId {
        len: 0,
        bytes: [0; BUILD_ID_LEN],
    };

    /// `bytes` as a build id.
    ///
    /// # Errors
    /// `CapacityError` when longer than 20 bytes.
    pub fn new(bytes: &[u8]) -> Result<Self, CapacityError> {
        if bytes.len() > BUILD_ID_LEN {
            return Err(CapacityError {
                capacity: BUILD_ID_LEN,
            });
        }
        let mut out = Self::NONE;
        out.bytes[..bytes.len()].copy_from_slice(bytes);
        // At most 20.
        out.len = u8::try_from(bytes.len()).unwrap_or(u8::MAX);
        Ok(out)
    }

    /// The id's bytes (empty when none).
    #[must_use]
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
    }

    /// Whether there is no build id.
    #[must_use]
    pub const fn is_none(&self) -> bool {
        self.len == 0
    }
}

impl fmt::Debug for BuildId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BuildId({self})")
    }
}

/// Lower-case hex, as `readelf -n` prints it.
impl fmt::Display for BuildId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in self.as_bytes() {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

/// One VM, as described in the header.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct VmInfo {
    /// The VM index used by `Sample::vm` / `Event::vm`.
    pub id: u16,
    /// Its name.
    pub name: FixedStr<VM_NAME_LEN>,
    /// Number of vCPUs.
    pub vcpus: u16,
    /// The guest image's file name.
    pub image: FixedStr<IMAGE_NAME_LEN>,
    /// The guest image's GNU build id (none if the image has none).
    pub image_build_id: BuildId,
}

/// Up to `MAX_VMS` `VmInfo`s, stored inline. Dereferences to a slice.
#[derive(Clone)]
pub struct VmList {
    len: u8,
    items: [VmInfo; MAX_VMS],
}

impl VmList {
    /// The empty list.
    #[must_use]
    pub const fn new() -> Self {
        const EMPTY: VmInfo = VmInfo {
            id: 0,
            name: FixedStr::new(),
            vcpus: 0,
            image: FixedStr::new(),
            image_build_id: BuildId::NONE,
        };
        Self {
            len: 0,
            items: [EMPTY; MAX_VMS],
        }
    }

    /// Appends `vm`.
    ///
    /// # Errors
    /// `CapacityError` when the list already holds `MAX_VMS` entries.
    pub fn push(&mut self, vm: VmInfo) -> Result<(), CapacityError> {
        let i = usize::from(self.len);
        if i >= MAX_VMS {
            return Err(CapacityError { capacity: MAX_VMS });
        }
        self.items[i] = vm;
        self.len += 1;
        Ok(())
    }

    /// Removes every entry.
    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// The entries.
    #[must_use]
    pub fn as_slice(&self) -> &[VmInfo] {
        &self.items[..usize::from(self.len)]
    }

    /// The entry whose `id` is `id`.
    #[must_use]
    pub fn by_id(&self, id: u16) -> Option<&VmInfo> {
        self.as_slice().iter().find(|v| v.id == id)
    }
}

impl Default for VmList {
    fn default() -> Self {
        Self::new()
    }
}

impl Deref for VmList {
    type Target = [VmInfo];
    fn deref(&self) -> &[VmInfo] {
        self.as_slice()
    }
}

impl PartialEq for VmList {
    fn eq(&self, other: &Self) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl Eq for VmList {}

impl fmt::Debug for VmList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.as_slice()).finish()
    }
}

/// The log header: what the host needs to interpret the blocks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    /// Format version (`FORMAT_VERSION`).
    pub version: u16,
    /// The hypervisor image's GNU build id.
    pub build_id: BuildId,
    /// TSC frequency in Hz.
    pub tsc_hz: u64,
    /// Number of pCPUs.
    pub pcpus: u16,
    /// Largest TSC skew measured across pCPUs, in ticks (0 if unknown).
    pub tsc_skew: u64,
    /// Nominal sampling period in TSC ticks.
    pub period_ticks: u64,
    /// `SOURCE_DEADLINE` or `SOURCE_PMU` (other values are carried as is).
    pub source: u8,
    /// The VMs.
    pub vms: VmList,
}

impl Default for Header {
    fn default() -> Self {
        Self {
            version: FORMAT_VERSION,
            build_id: BuildId::NONE,
            tsc_hz: 0,
            pcpus: 0,
            tsc_skew: 0,
            period_ticks: 0,
            source: SOURCE_DEADLINE,
            vms: VmList::new(),
        }
    }
}

/// The header of one block frame.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct BlockHeader {
    /// The pCPU whose records these are.
    pub pcpu: u16,
    /// Block sequence number on this pCPU: 0, 1, 2, …
    pub seq: u64,
    /// Index of the block's first sample in this pCPU's sample stream (samples in earlier blocks).
    pub first_sample: u64,
    /// Index of the block's first event in this pCPU's event stream (events in earlier blocks).
    pub first_event: u64,
    /// The pCPU's cumulative ring-drop counter when the block was built: samples the sample path
    /// could not record because the ring was full (they are in no block).
    pub ring_drops: u64,
    /// The nominal sampling period the sample TSCs are delta-coded against (any value decodes;
    /// the nominal period gives the smallest output).
    pub period_ticks: u64,
}

/// Per-pCPU totals, carried by the end frame.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct PcpuTotals {
    /// The pCPU.
    pub pcpu: u16,
    /// Samples sent in blocks (the length of the pCPU's sample stream).
    pub samples: u64,
    /// Events sent in blocks.
    pub events: u64,
    /// Samples the ring could not hold (final cumulative ring-drop counter).
    pub ring_drops: u64,
    /// Blocks sent (the next sequence number).
    pub blocks: u64,
}

/// Bytes of a task's name (`TASK_COMM_LEN` in Linux).
pub const COMM_LEN: usize = 16;

/// Which guest task a vCPU runs from `tsc` on, as the hypervisor read it from guest memory (a
/// task frame, type 4). The samples of that vCPU from `tsc` until its next task frame belong to
/// this task.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Task {
    /// The pCPU that read it.
    pub pcpu: u16,
    /// The TSC of the sample at which it was read.
    pub tsc: u64,
    /// VM index.
    pub vm: u16,
    /// vCPU within the VM.
    pub vcpu: u16,
    /// The guest CR3 at the time.
    pub cr3: u64,
    /// Guest-virtual address of the task's `task_struct`.
    pub task: u64,
    /// Thread id (Linux `pid`).
    pub pid: u32,
    /// Process id (Linux `tgid`).
    pub tgid: u32,
    /// The task's name.
    pub comm: FixedStr<COMM_LEN>,
}

/// Capacity of `Mapping::path` (a longer path keeps its end: the hypervisor cuts it from the
/// left and marks the cut with `…`).
pub const PATH_LEN: usize = 255;

/// What a [`Mapping`] maps.
#[repr(u8)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum MappingKind {
    /// An executable file mapping of a guest process (`path` is the file).
    #[default]
    Process = 0,
    /// A loaded guest kernel module (`path` is its name).
    Module = 1,
}

/// Executable code a guest maps, read from its memory by the hypervisor (mapping frame, type 7):
/// a file mapping of a process when the process is first seen (and after an exec), a kernel
/// module when the module list changes. Samples of that process (module) in `start..end` belong
/// to that file (module) from `tsc` on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Mapping {
    /// The pCPU that read it.
    pub pcpu: u16,
    /// The TSC at which it was read.
    pub tsc: u64,
    /// VM index.
    pub vm: u16,
    /// The vCPU whose memory view was read.
    pub vcpu: u16,
    /// Process mapping or module.
    pub kind: MappingKind,
    /// Process: the page-table root its maps were read through (its address space: the CR3
    /// without the PCID, and under page-table isolation the kernel's PGD of the pair; 0 for a
    /// module).
    pub cr3: u64,
    /// Process: its id (Linux `tgid`; 0 for a module).
    pub tgid: u32,
    /// First address mapped.
    pub start: u64,
    /// First address past the mapping (`> start`).
    pub end: u64,
    /// Process: the file offset of `start`, in 4 KiB pages (`vm_pgoff`); 0 for a module.
    pub pgoff: u64,
    /// Process: the file's path (`/usr/lib/x86_64-linux-gnu/libc.so.6`); module: its name.
    pub path: FixedStr<PATH_LEN>,
    /// The file's GNU build id when it could be read (the ELF note in memory), else none.
    pub build_id: BuildId,
}
