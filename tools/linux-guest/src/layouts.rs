//! The layouts the hypervisor's Linux walkers (`hvprof-linux-walk`) need — a process's memory
//! map in its maple tree, the mapped file's dentry chain, the module list — derived from the
//! kernel's own BTF (and the `modules` symbol from kallsyms), as the task offsets are.

use hvprof_linux_walk::{MapleLayout, MmLayout, ModuleLayout, OrcLayout};

use crate::Error;
use crate::btf::Btf;
use crate::kallsyms::Kallsyms;

/// Offset of `path` (`a.b.c`) in struct `st`, following embedded structs.
fn offset(btf: &Btf<'_>, st: &str, path: &str) -> Result<u32, Error> {
    let mut id = btf.struct_id(st)?;
    let mut total = 0u32;
    for part in path.split('.') {
        let m = btf
            .member(id, part)?
            .ok_or_else(|| Error::Btf(format!("struct {st} has no member {path}")))?;
        total = total
            .checked_add(m.offset)
            .ok_or_else(|| Error::Btf(format!("{st}.{path}: offset overflows")))?;
        id = m.type_id;
    }
    Ok(total)
}

/// The number of elements of array member `member` of `st`.
fn array_len(btf: &Btf<'_>, st: &str, member: &str) -> Result<u32, Error> {
    let id = btf.struct_id(st)?;
    let m = btf
        .member(id, member)?
        .ok_or_else(|| Error::Btf(format!("struct {st} has no member {member}")))?;
    btf.array_len(m.type_id)?
        .ok_or_else(|| Error::Btf(format!("{st}.{member} is not an array")))
}

/// The maple tree's node layout.
pub fn maple_layout(btf: &Btf<'_>) -> Result<MapleLayout, Error> {
    let range64_slots = array_len(btf, "maple_range_64", "slot")?;
    let arange64_slots = array_len(btf, "maple_arange_64", "slot")?;
    let layout = MapleLayout {
        node_size: btf.size_of(btf.struct_id("maple_node")?)?,
        range64_pivot: offset(btf, "maple_range_64", "pivot")?,
        range64_slot: offset(btf, "maple_range_64", "slot")?,
        range64_slots,
        range64_meta: offset(btf, "maple_range_64", "meta")?,
        arange64_pivot: offset(btf, "maple_arange_64", "pivot")?,
        arange64_slot: offset(btf, "maple_arange_64", "slot")?,
        arange64_slots,
        arange64_meta: offset(btf, "maple_arange_64", "meta")?,
        meta_end: offset(btf, "maple_metadata", "end")?,
    };
    if array_len(btf, "maple_range_64", "pivot")? + 1 != range64_slots
        || array_len(btf, "maple_arange_64", "pivot")? + 1 != arange64_slots
    {
        return Err(Error::Btf(
            "maple nodes do not have one pivot fewer than slots".into(),
        ));
    }
    if !layout.is_usable() {
        return Err(Error::Btf(format!(
            "the maple tree's node layout is not one the walker reads: {layout:?}"
        )));
    }
    Ok(layout)
}

/// Where a process's VMAs and a mapped file's name are. Fails on kernels before 6.1 (no maple
/// tree: VMAs were in a red-black tree and a list).
pub fn mm_layout(btf: &Btf<'_>) -> Result<MmLayout, Error> {
    Ok(MmLayout {
        mm_root: offset(btf, "mm_struct", "mm_mt")? + offset(btf, "maple_tree", "ma_root")?,
        vm_start: offset(btf, "vm_area_struct", "vm_start")?,
        vm_end: offset(btf, "vm_area_struct", "vm_end")?,
        vm_mm: offset(btf, "vm_area_struct", "vm_mm")?,
        vm_flags: offset(btf, "vm_area_struct", "vm_flags")?,
        vm_pgoff: offset(btf, "vm_area_struct", "vm_pgoff")?,
        vm_file: offset(btf, "vm_area_struct", "vm_file")?,
        file_dentry: offset(btf, "file", "f_path.dentry")?,
        d_parent: offset(btf, "dentry", "d_parent")?,
        d_name_len: offset(btf, "dentry", "d_name.len")?,
        d_name_name: offset(btf, "dentry", "d_name.name")?,
        task_mm: offset(btf, "task_struct", "mm")?,
        maple: maple_layout(btf)?,
    })
}

/// Where the module list and a module's name and core are (through Linux 6.3: `core_layout`;
/// 6.4 replaced it with `mem[]`, which this does not read yet).
pub fn module_layout(btf: &Btf<'_>, syms: &Kallsyms) -> Result<ModuleLayout, Error> {
    let modules = syms
        .by_name("modules")
        .ok_or_else(|| Error::Kallsyms("no symbol `modules` (CONFIG_MODULES off?)".into()))?
        .address;
    let entry_syscall_64 = syms
        .by_name("entry_SYSCALL_64")
        .ok_or_else(|| Error::Kallsyms("no symbol entry_SYSCALL_64".into()))?
        .address;
    Ok(ModuleLayout {
        modules,
        entry_syscall_64,
        list: offset(btf, "module", "list")?,
        name: offset(btf, "module", "name")?,
        name_len: array_len(btf, "module", "name")?,
        base: offset(btf, "module", "core_layout.base")?,
        size: offset(btf, "module", "core_layout.size")?,
    })
}

/// Where the ORC unwind tables are (`.orc_unwind_ip`, `.orc_unwind`, `.orc_lookup`, sections of
/// every kernel built with `CONFIG_UNWINDER_ORC`) and the text their lookup covers (`_stext` to
/// `_etext`). The entries' layout read is Linux 6.1's (6 bytes, a 2-bit type); 6.4 changed it.
pub fn orc_layout(elf: &object::File<'_>, syms: &Kallsyms) -> Result<OrcLayout, Error> {
    use object::{Object, ObjectSection};
    let section = |name: &str| {
        elf.section_by_name(name)
            .map(|s| (s.address(), s.size()))
            .ok_or_else(|| {
                Error::Elf(format!(
                    "no {name} section (the kernel is not built with CONFIG_UNWINDER_ORC?)"
                ))
            })
    };
    let symbol = |name: &str| {
        syms.by_name(name)
            .map(|s| s.address)
            .ok_or_else(|| Error::Kallsyms(format!("no symbol {name}")))
    };
    let (ip_table, ip_size) = section(".orc_unwind_ip")?;
    let (entries, entries_size) = section(".orc_unwind")?;
    let (lookup, lookup_size) = section(".orc_lookup")?;
    let count = ip_size / 4;
    if ip_size % 4 != 0 || entries_size != count * 6 {
        return Err(Error::Elf(format!(
            "ORC tables of {ip_size} and {entries_size} bytes do not pair 4-byte IPs with 6-byte \
             entries (a kernel after 6.3 has another entry layout)"
        )));
    }
    let layout = OrcLayout {
        entry_syscall_64: symbol("entry_SYSCALL_64")?,
        stext: symbol("_stext")?,
        etext: symbol("_etext")?,
        sinittext: symbol("_sinittext")?,
        einittext: symbol("_einittext")?,
        ip_table,
        entries,
        count: u32::try_from(count).map_err(|_| Error::Elf("too many ORC entries".into()))?,
        lookup,
        lookup_blocks: u32::try_from(lookup_size / 4)
            .map_err(|_| Error::Elf("too large .orc_lookup".into()))?,
    };
    OrcLayout::parse(&layout.to_string())
        .ok_or_else(|| Error::Elf(format!("implausible ORC layout {layout}")))
}
