//! A process's memory map: the VMAs of an `mm_struct`, kept (Linux 6.1 and later) in the maple
//! tree `mm->mm_mt`, and the name of the file a VMA maps.
//!
//! Maple tree encoding (Linux 6.1 `include/linux/maple_tree.h`, `lib/maple_tree.c`; these are
//! `#define`s, so not in BTF, and stable since the tree was merged): an entry that is a node has
//! its low two bits `10` and is above 4096 (`xa_is_node`); the node is at the entry with its low
//! 8 bits cleared (`MAPLE_NODE_MASK`, nodes are 256-byte aligned) and its type is bits 3..7
//! (`MAPLE_NODE_TYPE_SHIFT`, `MAPLE_NODE_TYPE_MASK`): 1 `maple_leaf_64`, 2 `maple_range_64`,
//! 3 `maple_arange_64` (0, dense, is not used for VMAs). Only the root carries the internal
//! tag (`MAPLE_ROOT_NODE`, 0x02): child slots hold `node | type << 3 | MAPLE_ENODE_NULL (0x04)`
//! (`mt_mk_node`). Leaf and range nodes have the layout of
//! `struct maple_range_64` (parent, pivots, slots, the metadata in the last slot when the node is
//! not full); allocation-range nodes that of `struct maple_arange_64` (parent, pivots, slots,
//! gaps, metadata). Slot `i` of a node covering `[min, max]` covers up to `pivot[i]`, the last
//! used slot up to `max`. A leaf's slots hold `struct vm_area_struct *` (0: a gap).
//! The number of used slots (`ma_data_end`): for an allocation-range node the metadata's `end`;
//! for the others, if the last pivot is 0 the metadata's `end`, else if it equals `max` the last
//! pivot's index, else the last slot's index.

use core::fmt;

use crate::{Budget, GuestMemory, Stop, field, kernel_ptr, read, read_u32, read_u64};

/// Where the fields of the maple tree's nodes are (from BTF: `struct maple_range_64`,
/// `struct maple_arange_64`, `struct maple_metadata`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct MapleLayout {
    /// `sizeof(struct maple_node)` (256).
    pub node_size: u32,
    /// `maple_range_64.pivot`, `.slot`, the number of slots (16) and `.meta`.
    pub range64_pivot: u32,
    /// See `range64_pivot`.
    pub range64_slot: u32,
    /// See `range64_pivot`.
    pub range64_slots: u32,
    /// See `range64_pivot`.
    pub range64_meta: u32,
    /// `maple_arange_64.pivot`, `.slot`, the number of slots (10) and `.meta`.
    pub arange64_pivot: u32,
    /// See `arange64_pivot`.
    pub arange64_slot: u32,
    /// See `arange64_pivot`.
    pub arange64_slots: u32,
    /// See `arange64_pivot`.
    pub arange64_meta: u32,
    /// `maple_metadata.end` (a byte).
    pub meta_end: u32,
}

/// Where a process's memory map and a mapped file's name are (from BTF).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct MmLayout {
    /// `mm_struct.mm_mt` (an embedded `struct maple_tree`) plus `maple_tree.ma_root`.
    pub mm_root: u32,
    /// `vm_area_struct.vm_start`, `.vm_end`, `.vm_mm`, `.vm_flags`, `.vm_pgoff`, `.vm_file`.
    pub vm_start: u32,
    /// See `vm_start`.
    pub vm_end: u32,
    /// See `vm_start`.
    pub vm_mm: u32,
    /// See `vm_start`.
    pub vm_flags: u32,
    /// See `vm_start`.
    pub vm_pgoff: u32,
    /// See `vm_start`.
    pub vm_file: u32,
    /// `file.f_path` plus `path.dentry`.
    pub file_dentry: u32,
    /// `dentry.d_parent`.
    pub d_parent: u32,
    /// `dentry.d_name` plus `qstr.len` (u32) and plus `qstr.name` (pointer).
    pub d_name_len: u32,
    /// See `d_name_len`.
    pub d_name_name: u32,
    /// `task_struct.mm` (a pointer; 0 for kernel threads).
    pub task_mm: u32,
    /// The tree's node layout.
    pub maple: MapleLayout,
}

impl MmLayout {
    /// The fields in the order of the compact form.
    fn fields(&self) -> [u32; 22] {
        let m = &self.maple;
        [
            self.mm_root,
            self.vm_start,
            self.vm_end,
            self.vm_mm,
            self.vm_flags,
            self.vm_pgoff,
            self.vm_file,
            self.file_dentry,
            self.d_parent,
            self.d_name_len,
            self.d_name_name,
            self.task_mm,
            m.node_size,
            m.range64_pivot,
            m.range64_slot,
            m.range64_slots,
            m.range64_meta,
            m.arange64_pivot,
            m.arange64_slot,
            m.arange64_slots,
            m.arange64_meta,
            m.meta_end,
        ]
    }

    /// Parses the compact form [`fmt::Display`] writes: 22 decimal numbers separated by `:`
    /// (the hypervisor's `mm-layout=` module argument). `None` if malformed or not walkable.
    #[must_use]
    pub fn parse(s: &str) -> Option<MmLayout> {
        let mut f = [0u32; 22];
        let mut parts = s.split(':');
        for slot in &mut f {
            *slot = parts.next()?.parse().ok()?;
        }
        if parts.next().is_some() {
            return None;
        }
        let l = MmLayout {
            mm_root: f[0],
            vm_start: f[1],
            vm_end: f[2],
            vm_mm: f[3],
            vm_flags: f[4],
            vm_pgoff: f[5],
            vm_file: f[6],
            file_dentry: f[7],
            d_parent: f[8],
            d_name_len: f[9],
            d_name_name: f[10],
            task_mm: f[11],
            maple: MapleLayout {
                node_size: f[12],
                range64_pivot: f[13],
                range64_slot: f[14],
                range64_slots: f[15],
                range64_meta: f[16],
                arange64_pivot: f[17],
                arange64_slot: f[18],
                arange64_slots: f[19],
                arange64_meta: f[20],
                meta_end: f[21],
            },
        };
        l.maple.is_usable().then_some(l)
    }
}

impl fmt::Display for MmLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, v) in self.fields().iter().enumerate() {
            if i > 0 {
                f.write_str(":")?;
            }
            write!(f, "{v}")?;
        }
        Ok(())
    }
}

/// `VM_EXEC` in `vm_flags` (`include/linux/mm.h`).
pub const VM_EXEC: u64 = 0x4;

/// One mapping of a process.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Vma {
    /// The `vm_area_struct`'s guest-virtual address.
    pub vma: u64,
    /// First address mapped.
    pub start: u64,
    /// First address past the mapping.
    pub end: u64,
    /// `vm_pgoff`: the file offset of `start`, in pages.
    pub pgoff: u64,
    /// `vm_flags` (`VM_EXEC` ...).
    pub flags: u64,
    /// The `struct file *` it maps, 0 for anonymous memory.
    pub file: u64,
}

impl Vma {
    /// Executable.
    #[must_use]
    pub const fn is_exec(&self) -> bool {
        self.flags & VM_EXEC != 0
    }
}

/// The outcome of [`walk_vmas`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VmaWalk {
    /// VMAs given to the sink.
    pub vmas: u32,
    /// Tree nodes read.
    pub nodes: u32,
    /// Why the walk ended early (`None`: every VMA was seen).
    pub stop: Option<Stop>,
}

/// The deepest a maple tree can be (`MAPLE_HEIGHT_MAX`).
const MAX_HEIGHT: usize = 31;
/// The largest node this walker reads (bytes).
const MAX_NODE: usize = 512;
const MAX_SLOTS: u32 = 32;

/// `xa_is_node`: an internal entry (low bits `10`) above 4096.
const fn is_node(entry: u64) -> bool {
    entry & 3 == 2 && entry > 4096
}

/// A child slot of an internal node holds an encoded node (`mt_mk_node`: the node's address,
/// its type in bits 3..6 and `MAPLE_ENODE_NULL`, 0x04): unlike the root (`mte_mk_root` adds
/// `MAPLE_ROOT_NODE`, 0x02, which makes it `xa_is_node`), it carries no internal-entry tag.
/// Bit 0 is never set in an encoded node.
const fn is_child_node(entry: u64) -> bool {
    entry & 1 == 0 && entry > 4096
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum NodeType {
    Leaf,
    Range,
    Arange,
}

/// A node read whole into a buffer.
struct Node {
    bytes: [u8; MAX_NODE],
    kind: NodeType,
    max: u64,
    end: u32,
    next: u32,
}

impl Node {
    fn word(&self, offset: u32, index: u32) -> u64 {
        let at = offset as usize + 8 * index as usize;
        self.bytes
            .get(at..at + 8)
            .and_then(|b| b.try_into().ok())
            .map_or(0, u64::from_le_bytes)
    }
}

impl MapleLayout {
    /// Whether the layout can be walked with this code (sizes within bounds, fields inside the
    /// node).
    #[must_use]
    pub fn is_usable(&self) -> bool {
        let inside =
            |offset: u32, n: u32| u64::from(offset) + 8 * u64::from(n) <= u64::from(self.node_size);
        self.node_size as usize <= MAX_NODE
            && (2..=MAX_SLOTS).contains(&self.range64_slots)
            && (2..=MAX_SLOTS).contains(&self.arange64_slots)
            && inside(self.range64_pivot, self.range64_slots - 1)
            && inside(self.range64_slot, self.range64_slots)
            && inside(self.arange64_pivot, self.arange64_slots - 1)
            && inside(self.arange64_slot, self.arange64_slots)
            && self.range64_meta + self.meta_end < self.node_size
            && self.arange64_meta + self.meta_end < self.node_size
    }

    fn shape(&self, kind: NodeType) -> (u32, u32, u32, u32) {
        match kind {
            NodeType::Leaf | NodeType::Range => (
                self.range64_pivot,
                self.range64_slot,
                self.range64_slots,
                self.range64_meta,
            ),
            NodeType::Arange => (
                self.arange64_pivot,
                self.arange64_slot,
                self.arange64_slots,
                self.arange64_meta,
            ),
        }
    }

    /// Reads the node `entry` encodes, covering up to `max`.
    fn read_node(
        &self,
        mem: &dyn GuestMemory,
        budget: &mut Budget,
        entry: u64,
        max: u64,
    ) -> Result<Node, Stop> {
        let kind = match (entry >> 3) & 0xf {
            1 => NodeType::Leaf,
            2 => NodeType::Range,
            3 => NodeType::Arange,
            _ => return Err(Stop::Malformed),
        };
        let addr = entry & !0xff;
        if !kernel_ptr(addr) {
            return Err(Stop::Malformed);
        }
        let mut node = Node {
            bytes: [0; MAX_NODE],
            kind,
            max,
            end: 0,
            next: 0,
        };
        read(
            mem,
            budget,
            addr,
            &mut node.bytes[..self.node_size as usize],
        )?;
        let (pivot, _, slots, meta) = self.shape(kind);
        let meta_end = || u32::from(node.bytes[(meta + self.meta_end) as usize]);
        let end = match kind {
            NodeType::Arange => meta_end(),
            _ => {
                let last = slots - 2;
                match node.word(pivot, last) {
                    0 => meta_end(),
                    p if p == max => last,
                    _ => slots - 1,
                }
            }
        };
        if end >= slots {
            return Err(Stop::Malformed);
        }
        node.end = end;
        Ok(node)
    }
}

/// Walks the VMAs of the `mm_struct` at `mm` in address order, giving each to `sink` (which
/// returns `false` to stop: it is full). Every VMA is checked: it points back to `mm`, it is not
/// empty, it starts at or after the previous one's end. Bounded by `budget`; never recurses.
pub fn walk_vmas(
    mem: &dyn GuestMemory,
    layout: &MmLayout,
    mm: u64,
    budget: &mut Budget,
    sink: &mut dyn FnMut(&Vma) -> bool,
) -> VmaWalk {
    let mut walk = VmaWalk::default();
    walk.stop = walk_inner(mem, layout, mm, budget, sink, &mut walk).err();
    walk
}

fn walk_inner(
    mem: &dyn GuestMemory,
    layout: &MmLayout,
    mm: u64,
    budget: &mut Budget,
    sink: &mut dyn FnMut(&Vma) -> bool,
    walk: &mut VmaWalk,
) -> Result<(), Stop> {
    let m = &layout.maple;
    if !m.is_usable() || !kernel_ptr(mm) {
        return Err(Stop::Malformed);
    }
    let root = read_u64(mem, budget, field(mm, layout.mm_root)?)?;
    let mut prev_end = 0u64;
    let mut visit = |vma_ptr: u64, budget: &mut Budget, walk: &mut VmaWalk| -> Result<(), Stop> {
        if vma_ptr == 0 || vma_ptr & 3 == 2 {
            return Ok(()); // a gap, or a reserved internal entry
        }
        let vma = read_vma(mem, layout, vma_ptr, budget)?;
        if vma.start >= vma.end || vma.start < prev_end {
            return Err(Stop::Malformed);
        }
        if read_u64(mem, budget, field(vma_ptr, layout.vm_mm)?)? != mm {
            return Err(Stop::Malformed);
        }
        prev_end = vma.end;
        walk.vmas += 1;
        if sink(&vma) { Ok(()) } else { Err(Stop::Full) }
    };
    if root == 0 {
        return Ok(());
    }
    if !is_node(root) {
        // A tree of one entry keeps it in the root (index 0 only: never a real VMA, but
        // whatever it is, it is checked like one).
        return visit(root, budget, walk);
    }
    let mut stack: [Option<Node>; MAX_HEIGHT + 1] = [const { None }; MAX_HEIGHT + 1];
    let mut depth = 0usize;
    stack[0] = Some(m.read_node(mem, budget, root, u64::MAX)?);
    walk.nodes += 1;
    loop {
        let Some(node) = stack[depth].as_mut() else {
            return Err(Stop::Malformed);
        };
        if node.next > node.end {
            if depth == 0 {
                return Ok(());
            }
            stack[depth] = None;
            depth -= 1;
            continue;
        }
        let i = node.next;
        node.next += 1;
        let (pivot, slot, slots, _) = m.shape(node.kind);
        let entry = node.word(slot, i);
        if node.kind == NodeType::Leaf {
            visit(entry, budget, walk)?;
            continue;
        }
        // An internal node: every used slot is a child node.
        let child_max = if i < slots - 1 && i < node.end {
            node.word(pivot, i)
        } else {
            node.max
        };
        if !is_child_node(entry) {
            return Err(Stop::Malformed);
        }
        if depth + 1 > MAX_HEIGHT {
            return Err(Stop::Malformed);
        }
        let child = m.read_node(mem, budget, entry, child_max)?;
        walk.nodes += 1;
        depth += 1;
        stack[depth] = Some(child);
    }
}

fn read_vma(
    mem: &dyn GuestMemory,
    layout: &MmLayout,
    vma: u64,
    budget: &mut Budget,
) -> Result<Vma, Stop> {
    if !kernel_ptr(vma) {
        return Err(Stop::Malformed);
    }
    let get = |offset: u32, budget: &mut Budget| read_u64(mem, budget, field(vma, offset)?);
    Ok(Vma {
        vma,
        start: get(layout.vm_start, budget)?,
        end: get(layout.vm_end, budget)?,
        pgoff: get(layout.vm_pgoff, budget)?,
        flags: get(layout.vm_flags, budget)?,
        file: get(layout.vm_file, budget)?,
    })
}

/// The deepest directory nesting [`file_path`] follows.
pub const MAX_PATH_DEPTH: u32 = 32;

/// Writes the path of the `struct file` at `file` (from its dentry up to its file system's
/// root: `/usr/lib/x86_64-linux-gnu/libc.so.6` for the root file system) into the end of `out`;
/// returns where the path starts in `out` and whether it is whole (`false`: cut at
/// `MAX_PATH_DEPTH` components or at `out`'s size, the missing part shown as `…`).
///
/// # Errors
/// A read failed, the budget ran out, or a name was absurd (empty, holding `/` or NUL).
pub fn file_path(
    mem: &dyn GuestMemory,
    layout: &MmLayout,
    file: u64,
    budget: &mut Budget,
    out: &mut [u8],
) -> Result<(usize, bool), Stop> {
    if !kernel_ptr(file) {
        return Err(Stop::Malformed);
    }
    let mut dentry = read_u64(mem, budget, field(file, layout.file_dentry)?)?;
    let mut at = out.len();
    for _ in 0..MAX_PATH_DEPTH {
        if !kernel_ptr(dentry) {
            return Err(Stop::Malformed);
        }
        let parent = read_u64(mem, budget, field(dentry, layout.d_parent)?)?;
        if parent == dentry {
            // The root: its name is "/", which the components already start with.
            if at == out.len() {
                at -= out.len().min(1);
                if let Some(b) = out.get_mut(at) {
                    *b = b'/';
                }
            }
            return Ok((at, true));
        }
        let len = read_u32(mem, budget, field(dentry, layout.d_name_len)?)? as usize;
        let name = read_u64(mem, budget, field(dentry, layout.d_name_name)?)?;
        if len == 0 || len > 255 {
            return Err(Stop::Malformed);
        }
        if len + 1 > at {
            return Ok(cut(out, at));
        }
        let dst = &mut out[at - len..at];
        read(mem, budget, name, dst)?;
        if dst.iter().any(|&b| b == b'/' || b == 0) {
            return Err(Stop::Malformed);
        }
        at -= len + 1;
        out[at] = b'/';
        dentry = parent;
    }
    Ok(cut(out, at))
}

/// Marks a path cut before `at` with `…` (when there is room); returns it as not whole.
fn cut(out: &mut [u8], at: usize) -> (usize, bool) {
    const ELLIPSIS: &[u8] = "…".as_bytes();
    if at >= ELLIPSIS.len() {
        out[at - ELLIPSIS.len()..at].copy_from_slice(ELLIPSIS);
        (at - ELLIPSIS.len(), false)
    } else {
        (at, false)
    }
}

/// The test layout, for the other modules' tests.
#[cfg(test)]
pub(crate) fn tests_layout() -> MmLayout {
    tests::LAYOUT
}

#[cfg(test)]
#[allow(clippy::cast_possible_truncation, reason = "test values are small")]
mod tests {
    use super::*;
    use crate::model::Memory;
    use proptest::prelude::*;

    /// Linux 6.1's layout (x86-64), as BTF gives it (checked against the real kernel's BTF by
    /// `linux-guest`'s tests).
    pub(crate) const LAYOUT: MmLayout = MmLayout {
        mm_root: 0x40 + 8,
        vm_start: 0,
        vm_end: 8,
        vm_mm: 16,
        vm_flags: 32,
        vm_pgoff: 120,
        vm_file: 128,
        file_dentry: 16 + 8,
        d_parent: 24,
        d_name_len: 32 + 4,
        d_name_name: 32 + 8,
        task_mm: 2272,
        maple: MapleLayout {
            node_size: 256,
            range64_pivot: 8,
            range64_slot: 128,
            range64_slots: 16,
            range64_meta: 248,
            arange64_pivot: 8,
            arange64_slot: 80,
            arange64_slots: 10,
            arange64_meta: 240,
            meta_end: 0,
        },
    };

    const MM: u64 = 0xffff_8880_0100_0000;

    /// Builds a tree over `vmas` (start, end) in `mem`: leaves of up to 16 entries (gaps
    /// between VMAs as empty slots) under arange nodes of up to 10 children, as many levels as
    /// needed. Returns the VMA addresses.
    fn build(mem: &mut Memory, vmas: &[(u64, u64)]) -> Vec<u64> {
        let mut next_node = 0xffff_8880_0200_0000u64;
        let mut alloc = |mem: &mut Memory| {
            let a = next_node;
            next_node += 256;
            mem.zero(a, 256);
            a
        };
        let mut addrs = Vec::new();
        // Leaf entries: (pivot, slot value).
        let mut entries: Vec<(u64, u64)> = Vec::new();
        let mut prev = 0u64;
        for (i, &(s, e)) in vmas.iter().enumerate() {
            let vma = 0xffff_8880_0300_0000 + 0x100 * i as u64;
            mem.zero(vma, 0x100);
            mem.put_u64(vma + u64::from(LAYOUT.vm_start), s);
            mem.put_u64(vma + u64::from(LAYOUT.vm_end), e);
            mem.put_u64(vma + u64::from(LAYOUT.vm_mm), MM);
            mem.put_u64(vma + u64::from(LAYOUT.vm_flags), VM_EXEC);
            mem.put_u64(vma + u64::from(LAYOUT.vm_pgoff), i as u64);
            addrs.push(vma);
            if s > prev {
                entries.push((s - 1, 0)); // the gap before it
            }
            entries.push((e - 1, vma));
            prev = e;
        }
        entries.push((u64::MAX, 0));
        // Level 0: leaves; encoded entries with their max.
        let mut level: Vec<(u64, u64)> = Vec::new();
        for chunk in entries.chunks(15) {
            let node = alloc(mem);
            let max = chunk.last().unwrap().0;
            for (i, &(pivot, slot)) in chunk.iter().enumerate() {
                if i < 15 {
                    mem.put_u64(node + 8 + 8 * i as u64, pivot);
                }
                mem.put_u64(node + 128 + 8 * i as u64, slot);
            }
            if chunk.len() < 16 {
                mem.bytes.insert(node + 248, (chunk.len() - 1) as u8);
            }
            level.push((max, node | (1 << 3) | 4)); // mt_mk_node(node, maple_leaf_64)
        }
        while level.len() > 1 {
            let mut up = Vec::new();
            for chunk in level.chunks(10) {
                let node = alloc(mem);
                let max = chunk.last().unwrap().0;
                for (i, &(pivot, child)) in chunk.iter().enumerate() {
                    if i < 9 {
                        mem.put_u64(node + 8 + 8 * i as u64, pivot);
                    }
                    mem.put_u64(node + 80 + 8 * i as u64, child);
                }
                mem.bytes.insert(node + 240, (chunk.len() - 1) as u8);
                up.push((max, node | (3 << 3) | 4)); // mt_mk_node(node, maple_arange_64)
            }
            level = up;
        }
        mem.zero(MM, 0x100);
        // mte_mk_root: the root alone is tagged MAPLE_ROOT_NODE.
        mem.put_u64(MM + u64::from(LAYOUT.mm_root), level[0].1 | 2);
        addrs
    }

    fn vmas(n: usize) -> Vec<(u64, u64)> {
        (0..n as u64)
            .map(|i| {
                (
                    0x40_0000 + i * 0x3000,
                    0x40_0000 + i * 0x3000 + 0x1000 + (i % 2) * 0x2000,
                )
            })
            .collect()
    }

    fn collect(mem: &Memory, budget: u32) -> (Vec<Vma>, VmaWalk) {
        let mut got = Vec::new();
        let w = walk_vmas(mem, &LAYOUT, MM, &mut Budget::new(budget), &mut |v| {
            got.push(*v);
            true
        });
        (got, w)
    }

    #[test]
    fn every_vma_in_order_at_every_tree_height() {
        for n in [1, 5, 14, 15, 40, 300, 2000] {
            let mut mem = Memory::default();
            let want = vmas(n);
            let addrs = build(&mut mem, &want);
            let (got, w) = collect(&mem, 1_000_000);
            assert_eq!(w.stop, None, "{n} VMAs");
            assert_eq!(
                got.iter().map(|v| (v.start, v.end)).collect::<Vec<_>>(),
                want,
                "{n} VMAs"
            );
            assert_eq!(got.iter().map(|v| v.vma).collect::<Vec<_>>(), addrs);
            assert!(got.iter().all(Vma::is_exec));
        }
    }

    #[test]
    fn the_compact_form_round_trips() {
        let s = LAYOUT.to_string();
        assert_eq!(s.split(':').count(), 22);
        assert_eq!(MmLayout::parse(&s), Some(LAYOUT));
        assert_eq!(MmLayout::parse(&s[..s.len() - 2]), None);
        assert_eq!(MmLayout::parse(&format!("{s}:1")), None);
        // A node layout the walker cannot read is refused.
        let mut bad = LAYOUT;
        bad.maple.node_size = 4096;
        assert_eq!(MmLayout::parse(&bad.to_string()), None);
    }

    #[test]
    fn an_empty_tree_has_no_vmas() {
        let mut mem = Memory::default();
        mem.zero(MM, 0x100);
        let (got, w) = collect(&mem, 100);
        assert!(got.is_empty());
        assert_eq!(w.stop, None);
    }

    #[test]
    fn the_budget_bounds_the_walk_and_says_so() {
        let mut mem = Memory::default();
        build(&mut mem, &vmas(300));
        let (got, w) = collect(&mem, 50);
        assert_eq!(w.stop, Some(Stop::Budget));
        assert!(got.len() < 300);
        assert!(mem.reads.get() <= 50);
    }

    #[test]
    fn a_vma_of_another_mm_or_out_of_order_stops_the_walk() {
        let mut mem = Memory::default();
        let addrs = build(&mut mem, &vmas(40));
        mem.put_u64(addrs[20] + u64::from(LAYOUT.vm_mm), MM + 0x1000);
        let (got, w) = collect(&mem, 100_000);
        assert_eq!((got.len(), w.stop), (20, Some(Stop::Malformed)));
        let mut mem = Memory::default();
        let addrs = build(&mut mem, &vmas(40));
        mem.put_u64(addrs[10] + u64::from(LAYOUT.vm_start), 0);
        let (got, w) = collect(&mem, 100_000);
        assert_eq!((got.len(), w.stop), (10, Some(Stop::Malformed)));
    }

    #[test]
    fn a_node_pointing_to_itself_is_bounded() {
        // An arange root whose every child is the root itself: the height bound stops it.
        let mut mem = Memory::default();
        let node = 0xffff_8880_0200_0000u64;
        mem.zero(node, 256);
        let entry = node | (3 << 3) | 2;
        for i in 0..10 {
            mem.put_u64(node + 80 + 8 * i, entry);
        }
        mem.bytes.insert(node + 240, 9);
        mem.zero(MM, 0x100);
        mem.put_u64(MM + u64::from(LAYOUT.mm_root), entry);
        let (got, w) = collect(&mem, 1_000_000);
        assert!(got.is_empty());
        assert_eq!(w.stop, Some(Stop::Malformed));
        assert!(w.nodes as usize <= MAX_HEIGHT + 1);
    }

    proptest! {
        /// Whatever the memory holds, the walk ends within its budget, never panics, and what
        /// it gives is sorted, disjoint and non-empty.
        #[test]
        fn garbage_is_bounded(
            words in prop::collection::vec(any::<u64>(), 1..400),
            seed in prop::collection::vec((0usize..400, prop_oneof![
                Just(0u64),
                (0u64..64).prop_map(|i| (0xffff_8880_0200_0000 + 256 * i) | (1 << 3) | 2),
                (0u64..64).prop_map(|i| (0xffff_8880_0200_0000 + 256 * i) | (3 << 3) | 2),
                (0u64..64).prop_map(|i| 0xffff_8880_0200_0000 + 8 * i),
                Just(MM),
            ]), 0..200),
            budget in 1u32..5000,
        ) {
            let mut mem = Memory::default();
            let base = 0xffff_8880_0200_0000u64;
            for (i, w) in words.iter().enumerate() {
                mem.put_u64(base + 8 * (i as u64 % 2048), *w);
            }
            for (i, w) in seed {
                mem.put_u64(base + 8 * i as u64, w);
            }
            mem.zero(MM, 0x100);
            mem.put_u64(MM + u64::from(LAYOUT.mm_root), base | (3 << 3) | 2);
            let (got, _) = collect(&mem, budget);
            prop_assert!(mem.reads.get() <= u64::from(budget));
            prop_assert!(got.windows(2).all(|w| w[0].end <= w[1].start));
            prop_assert!(got.iter().all(|v| v.start < v.end));
        }
    }

    fn dentry(mem: &mut Memory, at: u64, parent: u64, name: &str) {
        mem.zero(at, 0x100);
        mem.put_u64(at + u64::from(LAYOUT.d_parent), parent);
        mem.put_u32(at + u64::from(LAYOUT.d_name_len), name.len() as u32);
        let s = at + 0x80;
        mem.put_u64(at + u64::from(LAYOUT.d_name_name), s);
        mem.put(s, name.as_bytes());
    }

    fn path_of(mem: &Memory, file: u64, out_len: usize) -> Result<(String, bool), Stop> {
        let mut out = vec![0u8; out_len];
        let (at, whole) = file_path(mem, &LAYOUT, file, &mut Budget::new(1000), &mut out)?;
        Ok((String::from_utf8(out[at..].to_vec()).unwrap(), whole))
    }

    #[test]
    fn file_paths_come_from_the_dentry_chain() {
        let mut mem = Memory::default();
        let d = |i: u64| 0xffff_8880_0400_0000 + 0x100 * i;
        dentry(&mut mem, d(0), d(0), "/");
        dentry(&mut mem, d(1), d(0), "usr");
        dentry(&mut mem, d(2), d(1), "lib");
        dentry(&mut mem, d(3), d(2), "libc.so.6");
        let file = 0xffff_8880_0500_0000;
        mem.zero(file, 0x100);
        mem.put_u64(file + u64::from(LAYOUT.file_dentry), d(3));
        assert_eq!(
            path_of(&mem, file, 256),
            Ok(("/usr/lib/libc.so.6".into(), true))
        );
        // Too long for the buffer: cut, marked.
        let (p, whole) = path_of(&mem, file, 17).unwrap();
        assert!(
            !whole && p.starts_with('…') && p.ends_with("/libc.so.6"),
            "{p}"
        );
        // A file at the root of the root.
        mem.put_u64(file + u64::from(LAYOUT.file_dentry), d(0));
        assert_eq!(path_of(&mem, file, 64), Ok(("/".into(), true)));
        // A loop of dentries that never reaches a root: cut at MAX_PATH_DEPTH.
        dentry(&mut mem, d(5), d(6), "a");
        dentry(&mut mem, d(6), d(5), "b");
        mem.put_u64(file + u64::from(LAYOUT.file_dentry), d(5));
        let (p, whole) = path_of(&mem, file, 4096).unwrap();
        assert!(
            !whole && p.matches('/').count() == MAX_PATH_DEPTH as usize,
            "{p}"
        );
        // A name holding a slash is refused.
        dentry(&mut mem, d(7), d(0), "a/b");
        mem.put_u64(file + u64::from(LAYOUT.file_dentry), d(7));
        assert_eq!(path_of(&mem, file, 64), Err(Stop::Malformed));
    }
}
