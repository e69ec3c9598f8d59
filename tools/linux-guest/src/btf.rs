//! A small reader of the kernel's BPF Type Format (`.BTF` section, the same bytes as the guest's
//! `/sys/kernel/btf/vmlinux`; format in the kernel's `Documentation/bpf/btf.rst`).
//!
//! Only what the profiler needs: named structs and unions, their members (through anonymous
//! members and typedef/qualifier chains), array lengths, and the variables of a data section.
//! It borrows the section, checks every length against it, and never panics on bad input.
//! (btf-rs 2.0 parses the whole section into owned types and has `expect`s in its accessors;
//! three kinds do not need it.)

use crate::Error;

const MAGIC: u16 = 0xeb9f;
/// Members visited in one [`Btf::member`] search at most (task_struct has about 250; bad input
/// could nest anonymous members into an exponential search).
const MEMBER_BUDGET: u32 = 100_000;

// BTF_KIND_*
const INT: u32 = 1;
const PTR: u32 = 2;
const ARRAY: u32 = 3;
const STRUCT: u32 = 4;
const UNION: u32 = 5;
const ENUM: u32 = 6;
const FWD: u32 = 7;
const TYPEDEF: u32 = 8;
const VOLATILE: u32 = 9;
const CONST: u32 = 10;
const RESTRICT: u32 = 11;
const FUNC: u32 = 12;
const FUNC_PROTO: u32 = 13;
const VAR: u32 = 14;
const DATASEC: u32 = 15;
const FLOAT: u32 = 16;
const DECL_TAG: u32 = 17;
const TYPE_TAG: u32 = 18;
const ENUM64: u32 = 19;

/// One type record: where it starts in the type area, its kind, vlen, name, size/type.
#[derive(Clone, Copy, Debug)]
struct TypeRec {
    /// Offset of the record's extra data (after the 12-byte common header) in `types`.
    extra: usize,
    kind: u32,
    vlen: usize,
    kind_flag: bool,
    name_off: u32,
    size_or_type: u32,
}

/// A parsed BTF blob (borrowed).
pub struct Btf<'a> {
    types: &'a [u8],
    strings: &'a [u8],
    /// `recs[id - 1]` is type `id` (id 0 is void).
    recs: Vec<TypeRec>,
}

/// A member found by [`Btf::member`]: its byte offset from the start of the outer struct, and
/// its type id (qualifiers and typedefs skipped).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemberInfo {
    pub offset: u32,
    pub type_id: u32,
}

fn bad(what: impl Into<String>) -> Error {
    Error::Btf(what.into())
}

fn rd32(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(
        b.get(at..at.checked_add(4)?)?.try_into().ok()?,
    ))
}

impl<'a> Btf<'a> {
    /// Parses a little-endian BTF blob.
    pub fn parse(blob: &'a [u8]) -> Result<Self, Error> {
        if blob.len() < 24 {
            return Err(bad(format!(
                "{} bytes is too short for a BTF header",
                blob.len()
            )));
        }
        let magic = u16::from_le_bytes([blob[0], blob[1]]);
        if magic != MAGIC {
            return Err(bad(format!(
                "magic {magic:#06x}, not 0xeb9f (or a big-endian BTF, which is not supported)"
            )));
        }
        if blob[2] != 1 {
            return Err(bad(format!("BTF version {}, only 1 is known", blob[2])));
        }
        let field = |at| rd32(blob, at).unwrap_or(0) as usize;
        let hdr_len = field(4);
        let (type_off, type_len, str_off, str_len) = (field(8), field(12), field(16), field(20));
        let area = |off: usize, len: usize, what: &str| {
            hdr_len
                .checked_add(off)
                .and_then(|s| Some(s..s.checked_add(len)?))
                .filter(|r| r.end <= blob.len() && hdr_len >= 24)
                .map(|r| &blob[r])
                .ok_or_else(|| {
                    bad(format!(
                        "{what} area (header {hdr_len} + {off:#x}, {len:#x} bytes) is outside the {}-byte blob",
                        blob.len()
                    ))
                })
        };
        let types = area(type_off, type_len, "type")?;
        let strings = area(str_off, str_len, "string")?;
        let mut recs = Vec::new();
        let mut at = 0usize;
        while at < types.len() {
            let header = |i: usize| {
                rd32(types, at + 4 * i)
                    .ok_or_else(|| bad(format!("type {} truncated at {at:#x}", recs.len() + 1)))
            };
            let (name_off, info, size_or_type) = (header(0)?, header(1)?, header(2)?);
            let kind = (info >> 24) & 0x1f;
            let vlen = (info & 0xffff) as usize;
            let extra_len = match kind {
                INT | VAR | DECL_TAG => 4,
                PTR | FWD | TYPEDEF | VOLATILE | CONST | RESTRICT | FUNC | FLOAT | TYPE_TAG => 0,
                ARRAY => 12,
                STRUCT | UNION | DATASEC | ENUM64 => 12 * vlen,
                ENUM | FUNC_PROTO => 8 * vlen,
                _ => {
                    return Err(bad(format!(
                        "type {} at {at:#x} has unknown kind {kind}",
                        recs.len() + 1
                    )));
                }
            };
            let extra = at + 12;
            if extra + extra_len > types.len() {
                return Err(bad(format!(
                    "type {} at {at:#x} runs past the end of the type area",
                    recs.len() + 1
                )));
            }
            recs.push(TypeRec {
                extra,
                kind,
                vlen,
                kind_flag: info >> 31 != 0,
                name_off,
                size_or_type,
            });
            at = extra + extra_len;
        }
        Ok(Self {
            types,
            strings,
            recs,
        })
    }

    /// Number of types (ids 1..=len).
    pub fn len(&self) -> usize {
        self.recs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.recs.is_empty()
    }

    fn rec(&self, id: u32) -> Result<&TypeRec, Error> {
        (id as usize)
            .checked_sub(1)
            .and_then(|i| self.recs.get(i))
            .ok_or_else(|| {
                bad(format!(
                    "type id {id} does not exist ({} types)",
                    self.recs.len()
                ))
            })
    }

    fn name(&self, off: u32) -> &'a str {
        let tail = self.strings.get(off as usize..).unwrap_or(&[]);
        let end = tail.iter().position(|&c| c == 0).unwrap_or(tail.len());
        std::str::from_utf8(&tail[..end]).unwrap_or("")
    }

    fn u32_at(&self, at: usize) -> u32 {
        // In range: checked in `parse` for every record's extra data.
        rd32(self.types, at).unwrap_or(0)
    }

    /// The id of the struct (or union) of this name that has members (not a forward declaration).
    pub fn struct_id(&self, name: &str) -> Result<u32, Error> {
        self.recs
            .iter()
            .position(|r| {
                matches!(r.kind, STRUCT | UNION) && r.vlen > 0 && self.name(r.name_off) == name
            })
            .map(|i| i as u32 + 1)
            .ok_or_else(|| bad(format!("no struct {name} in the BTF")))
    }

    /// Skips typedefs and qualifiers (bounded, so a cycle in bad input is an error).
    pub fn resolve(&self, mut id: u32) -> Result<u32, Error> {
        for _ in 0..64 {
            if id == 0 {
                return Ok(0);
            }
            let r = self.rec(id)?;
            match r.kind {
                TYPEDEF | VOLATILE | CONST | RESTRICT | TYPE_TAG => id = r.size_or_type,
                _ => return Ok(id),
            }
        }
        Err(bad(format!("type chain from {id} is too long (a cycle?)")))
    }

    /// The number of elements of an array type (after resolving), None for other kinds.
    pub fn array_len(&self, id: u32) -> Result<Option<u32>, Error> {
        let r = self.rec(self.resolve(id)?)?;
        Ok((r.kind == ARRAY).then(|| self.u32_at(r.extra + 8)))
    }

    /// The byte size of a struct, union, int, enum or float type (after resolving).
    pub fn size_of(&self, id: u32) -> Result<u32, Error> {
        let r = self.rec(self.resolve(id)?)?;
        match r.kind {
            STRUCT | UNION | INT | ENUM | ENUM64 | FLOAT | DATASEC => Ok(r.size_or_type),
            PTR => Ok(8),
            k => Err(bad(format!("type {id} (kind {k}) has no size of its own"))),
        }
    }

    /// Finds `member` of struct/union `id`, looking inside anonymous struct/union members.
    pub fn member(&self, id: u32, member: &str) -> Result<Option<MemberInfo>, Error> {
        let mut budget = MEMBER_BUDGET;
        self.member_in(id, member, 0, 0, &mut budget)
    }

    fn member_in(
        &self,
        id: u32,
        member: &str,
        base: u32,
        depth: u32,
        budget: &mut u32,
    ) -> Result<Option<MemberInfo>, Error> {
        if depth > 16 {
            return Err(bad("anonymous members nested too deep (a cycle?)"));
        }
        let id = self.resolve(id)?;
        let r = *self.rec(id)?;
        if !matches!(r.kind, STRUCT | UNION) {
            return Ok(None);
        }
        for i in 0..r.vlen {
            *budget = budget
                .checked_sub(1)
                .ok_or_else(|| bad(format!("looking for {member}: too many members visited")))?;
            let at = r.extra + 12 * i;
            let (name_off, type_id, raw) =
                (self.u32_at(at), self.u32_at(at + 4), self.u32_at(at + 8));
            let (bits, bitfield) = if r.kind_flag {
                (raw & 0xff_ffff, raw >> 24)
            } else {
                (raw, 0)
            };
            let name = self.name(name_off);
            if name == member {
                if bits % 8 != 0 || bitfield != 0 {
                    return Err(bad(format!("member {member} is a bit field")));
                }
                return Ok(Some(MemberInfo {
                    offset: base.saturating_add(bits / 8),
                    type_id: self.resolve(type_id)?,
                }));
            }
            if name.is_empty()
                && bits % 8 == 0
                && let Some(found) = self.member_in(
                    type_id,
                    member,
                    base.saturating_add(bits / 8),
                    depth + 1,
                    budget,
                )?
            {
                return Ok(Some(found));
            }
        }
        Ok(None)
    }

    /// The offset of variable `var` in data section `section` (e.g. `.data..percpu`).
    pub fn datasec_var(&self, section: &str, var: &str) -> Result<Option<u32>, Error> {
        for r in self.recs.iter().filter(|r| r.kind == DATASEC) {
            if self.name(r.name_off) != section {
                continue;
            }
            for i in 0..r.vlen {
                let at = r.extra + 12 * i;
                let v = self.rec(self.u32_at(at))?;
                if v.kind == VAR && self.name(v.name_off) == var {
                    return Ok(Some(self.u32_at(at + 4)));
                }
            }
        }
        Ok(None)
    }
}

/// Builds BTF blobs for tests.
#[doc(hidden)]
pub mod synth {
    /// A BTF blob under construction: types are added in order, ids from 1.
    #[derive(Default)]
    pub struct Builder {
        types: Vec<u8>,
        strings: Vec<u8>,
        next_id: u32,
    }

    impl Builder {
        pub fn new() -> Self {
            Self {
                types: Vec::new(),
                strings: vec![0],
                next_id: 1,
            }
        }

        fn str(&mut self, s: &str) -> u32 {
            if s.is_empty() {
                return 0;
            }
            let off = self.strings.len() as u32;
            self.strings.extend_from_slice(s.as_bytes());
            self.strings.push(0);
            off
        }

        fn head(&mut self, name: &str, kind: u32, vlen: u32, flag: bool, size_or_type: u32) -> u32 {
            let n = self.str(name);
            let info = (kind << 24) | vlen | (u32::from(flag) << 31);
            for w in [n, info, size_or_type] {
                self.types.extend_from_slice(&w.to_le_bytes());
            }
            self.next_id += 1;
            self.next_id - 1
        }

        pub fn int(&mut self, name: &str, size: u32) -> u32 {
            let id = self.head(name, super::INT, 0, false, size);
            self.types.extend_from_slice(&(size * 8).to_le_bytes());
            id
        }

        pub fn ptr(&mut self, to: u32) -> u32 {
            self.head("", super::PTR, 0, false, to)
        }

        pub fn typedef(&mut self, name: &str, to: u32) -> u32 {
            self.head(name, super::TYPEDEF, 0, false, to)
        }

        pub fn array(&mut self, elem: u32, index: u32, n: u32) -> u32 {
            let id = self.head("", super::ARRAY, 0, false, 0);
            for w in [elem, index, n] {
                self.types.extend_from_slice(&w.to_le_bytes());
            }
            id
        }

        /// A struct with members (name, type, bit offset).
        pub fn structure(&mut self, name: &str, size: u32, members: &[(&str, u32, u32)]) -> u32 {
            self.record(name, super::STRUCT, size, members)
        }

        pub fn union(&mut self, name: &str, size: u32, members: &[(&str, u32, u32)]) -> u32 {
            self.record(name, super::UNION, size, members)
        }

        fn record(
            &mut self,
            name: &str,
            kind: u32,
            size: u32,
            members: &[(&str, u32, u32)],
        ) -> u32 {
            let id = self.head(name, kind, members.len() as u32, false, size);
            for &(m, t, bits) in members {
                let n = self.str(m);
                for w in [n, t, bits] {
                    self.types.extend_from_slice(&w.to_le_bytes());
                }
            }
            id
        }

        pub fn var(&mut self, name: &str, ty: u32) -> u32 {
            let id = self.head(name, super::VAR, 0, false, ty);
            self.types.extend_from_slice(&1u32.to_le_bytes());
            id
        }

        pub fn datasec(&mut self, name: &str, vars: &[(u32, u32, u32)]) -> u32 {
            let id = self.head(name, super::DATASEC, vars.len() as u32, false, 0);
            for &(v, off, size) in vars {
                for w in [v, off, size] {
                    self.types.extend_from_slice(&w.to_le_bytes());
                }
            }
            id
        }

        pub fn finish(self) -> Vec<u8> {
            let mut v = Vec::new();
            v.extend_from_slice(&0xeb9fu16.to_le_bytes());
            v.extend_from_slice(&[1, 0]);
            for w in [
                24u32,
                0,
                self.types.len() as u32,
                self.types.len() as u32,
                self.strings.len() as u32,
            ] {
                v.extend_from_slice(&w.to_le_bytes());
            }
            v.extend_from_slice(&self.types);
            v.extend_from_slice(&self.strings);
            v
        }
    }
}

#[cfg(test)]
mod tests {
    use super::synth::Builder;
    use super::*;

    #[test]
    fn members_are_found_through_anonymous_records_and_typedefs() {
        let mut b = Builder::new();
        let int = b.int("int", 4);
        let pid_t = b.typedef("pid_t", int);
        let ch = b.int("char", 1);
        let comm = b.array(ch, int, 16);
        let inner = b.structure("", 16, &[("pgd", int, 64)]);
        let anon = b.union("", 16, &[("x", int, 0), ("", inner, 0)]);
        let mm = b.structure("mm_struct", 64, &[("a", int, 0), ("", anon, 128)]);
        let t = b.structure(
            "task_struct",
            100,
            &[("pid", pid_t, 8 * 20), ("comm", comm, 8 * 40)],
        );
        let blob = b.finish();
        let btf = Btf::parse(&blob).unwrap();
        assert_eq!(btf.len(), 8);
        let task = btf.struct_id("task_struct").unwrap();
        assert_eq!(task, t);
        let pid = btf.member(task, "pid").unwrap().unwrap();
        assert_eq!(
            pid,
            MemberInfo {
                offset: 20,
                type_id: int
            }
        );
        let c = btf.member(task, "comm").unwrap().unwrap();
        assert_eq!(btf.array_len(c.type_id).unwrap(), Some(16));
        assert_eq!(btf.member(task, "nope").unwrap(), None);
        // pgd sits at 16 (the union) + 8 (inside the anonymous struct).
        let pgd = btf.member(mm, "pgd").unwrap().unwrap();
        assert_eq!(pgd.offset, 24);
        assert_eq!(btf.size_of(mm).unwrap(), 64);
    }

    #[test]
    fn bad_blobs_are_named() {
        let e = |b: &[u8]| Btf::parse(b).err().unwrap().to_string();
        assert!(e(&[0; 10]).contains("too short"));
        assert!(e(&[0; 24]).contains("magic"));
        let mut blob = Builder::new().finish();
        blob[20..24].copy_from_slice(&1000u32.to_le_bytes());
        assert!(e(&blob).contains("string area"));
        let mut b = Builder::new();
        b.int("int", 4);
        let mut blob = b.finish();
        blob[24 + 7] = 30; // kind 30 in the info word's top byte
        assert!(e(&blob).contains("unknown kind 30"), "{}", e(&blob));
    }

    #[test]
    fn datasec_vars_are_found() {
        let mut b = Builder::new();
        let int = b.int("int", 4);
        let p = b.ptr(int);
        let v = b.var("current_task", p);
        let w = b.var("other", int);
        b.datasec(".data..percpu", &[(w, 0x10, 4), (v, 0x1fbc0, 8)]);
        let blob = b.finish();
        let btf = Btf::parse(&blob).unwrap();
        assert_eq!(
            btf.datasec_var(".data..percpu", "current_task").unwrap(),
            Some(0x1fbc0)
        );
        assert_eq!(btf.datasec_var(".data", "current_task").unwrap(), None);
    }
}
