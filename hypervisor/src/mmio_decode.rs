//! The guest instruction behind an access to an emulated MMIO page (the xAPIC registers): an
//! EPT violation gives the guest-physical address but neither the value written nor the
//! register read into, nor the instruction's length (the VM-exit instruction-length field is
//! undefined for EPT violations, SDM Vol. 3C §28.2.5). Compilers reach the APIC with plain
//! moves (Linux's `native_apic_mem_read`/`_write` are 32-bit `movl`; a kvm-unit-tests kernel's
//! `memset` over a disabled APIC's page stores bytes), so this decodes exactly the moves:
//! `MOV r/m8, r8` (88 /r), `MOV r/m, r` (89 /r), `MOV r8, r/m8` (8A /r), `MOV r, r/m` (8B /r),
//! `MOV r/m8, imm8` (C6 /0) and `MOV r/m, imm` (C7 /0), of 8, 16 (66 prefix), 32 or 64 bits
//! (REX.W), with segment and address-size prefixes and REX.R/X/B in 64-bit mode, and the moves
//! between the accumulator and an absolute address (A0-A3, `MOV AL/eAX, moffs` and back: a
//! compiler's load from a constant address in 64-bit mode, as kvm-unit-tests' apic.flat reads
//! its moved APIC). Anything else
//! (a string move, a locked or read-modify-write instruction) is refused: the caller reports
//! it instead of guessing. Which sizes a device takes is the caller's rule.
//!
//! SDM Vol. 2A §2.1 "Instruction Format for Protected Mode, Real-Address Mode, and
//! Virtual-8086 Mode" (prefixes, ModR/M, SIB, displacement, immediate; Tables 2-2 and 2-3 for
//! 32-bit addressing), §2.2.1 "REX Prefixes", §2.2.1.6 "RIP-Relative Addressing"; Vol. 2B, MOV.

/// The longest x86 instruction.
pub const MAX_LEN: usize = 15;

/// What the instruction does with the MMIO location ([`Access::size`] bytes of it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Loads it into general register `reg` (0-15; see [`Access::size`] for what happens to the
    /// rest of the register).
    Read { reg: u8 },
    /// Stores the low bytes of general register `reg`.
    Write { reg: u8 },
    /// Stores this immediate (an 8-, 16- or 32-bit immediate; a 64-bit store sign-extends its
    /// 32-bit immediate, whose low 32 bits are these).
    WriteImm { imm: u32 },
}

/// A decoded access and the instruction's length (the guest's RIP moves on by it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Access {
    pub op: Op,
    pub len: usize,
    /// Bytes accessed: 1, 2, 4 or 8. A load of 4 zeroes the register's upper half; of 1 or 2,
    /// it leaves the rest of the register as it was (SDM Vol. 1 §3.4.1.1).
    pub size: u8,
    /// A byte register without REX numbered 4-7 is AH, CH, DH or BH: bits 15:8 of register
    /// `reg` (0-3 here), not its low byte (SDM Vol. 2A §3.1.1.1, Table 3-1).
    pub high_byte: bool,
}

/// Why an instruction was not decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeError {
    /// An opcode, prefix or operand size this does not emulate (the first byte that is not a
    /// prefix).
    Unsupported(u8),
    /// A register operand where a memory one was needed (cannot have caused the access).
    NotMemory,
    /// The bytes end before the instruction does.
    Truncated,
}

impl core::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            DecodeError::Unsupported(b) => write!(
                f,
                "an instruction other than a MOV (opcode or prefix {b:#04x})"
            ),
            DecodeError::NotMemory => f.write_str("a MOV without a memory operand"),
            DecodeError::Truncated => f.write_str("an instruction cut short"),
        }
    }
}

/// Decodes the instruction in `bytes` (at most `MAX_LEN` are looked at), fetched in 64-bit mode
/// (`long`) or 32-bit protected mode.
pub fn decode(bytes: &[u8], long: bool) -> Result<Access, DecodeError> {
    let bytes = &bytes[..bytes.len().min(MAX_LEN)];
    let byte = |i: usize| bytes.get(i).copied().ok_or(DecodeError::Truncated);
    let mut i = 0;
    // Legacy prefixes: segment overrides and address size change nothing here (the GPA is
    // known); operand size makes a 16-bit access; LOCK and REP are not emulated.
    let mut operand16 = false;
    let mut address_size = false;
    loop {
        match byte(i)? {
            0x26 | 0x2e | 0x36 | 0x3e | 0x64 | 0x65 => {}
            0x66 => operand16 = true,
            0x67 => address_size = true,
            _ => break,
        }
        i += 1;
    }
    // REX, only in 64-bit mode and right before the opcode.
    let mut rex = 0u8;
    if long && (0x40..=0x4f).contains(&byte(i)?) {
        rex = byte(i)?;
        i += 1;
    }
    let opcode = byte(i)?;
    i += 1;
    let byte_op = match opcode {
        0x88 | 0x8a | 0xc6 | 0xa0 | 0xa2 => true,
        0x89 | 0x8b | 0xc7 | 0xa1 | 0xa3 => false,
        _ => return Err(DecodeError::Unsupported(opcode)),
    };
    // REX.W wins over 66 (SDM Vol. 2A §2.2.1.2); neither changes a byte move.
    let size = match (byte_op, rex & 0x08 != 0, operand16) {
        (true, _, _) => 1,
        (false, true, _) => 8,
        (false, false, true) => 2,
        (false, false, false) => 4,
    };
    if (0xa0..=0xa3).contains(&opcode) {
        // The offset has the address size: 8 bytes in 64-bit mode, 4 with 67; in 32-bit
        // mode 4, 2 with 67 (Vol. 2B, MOV: "moffs"). The register is AL, AX, EAX or RAX.
        let offset = match (long, address_size) {
            (true, false) => 8,
            (true, true) | (false, false) => 4,
            (false, true) => 2,
        };
        i += offset;
        if i > bytes.len() {
            return Err(DecodeError::Truncated);
        }
        let op = if opcode <= 0xa1 {
            Op::Read { reg: 0 }
        } else {
            Op::Write { reg: 0 }
        };
        return Ok(Access {
            op,
            len: i,
            size,
            high_byte: false,
        });
    }
    let modrm = byte(i)?;
    i += 1;
    let (md, reg, rm) = (modrm >> 6, (modrm >> 3) & 7, modrm & 7);
    if md == 3 {
        return Err(DecodeError::NotMemory);
    }
    // SIB, then the displacement (32-bit addressing and 64-bit mode share these rules).
    let mut disp = match md {
        1 => 1,
        2 => 4,
        _ => 0,
    };
    if rm == 4 {
        let sib = byte(i)?;
        i += 1;
        if md == 0 && sib & 7 == 5 {
            disp = 4;
        }
    } else if md == 0 && rm == 5 {
        // disp32 (RIP-relative in 64-bit mode).
        disp = 4;
    }
    i += disp;
    let high_byte = byte_op && rex == 0 && (4..8).contains(&reg);
    let reg = if high_byte {
        reg - 4
    } else {
        reg | ((rex & 0x04) << 1)
    };
    let op = match opcode {
        0x88 | 0x89 => Op::Write { reg },
        0x8a | 0x8b => Op::Read { reg },
        _ => {
            // C6 /0 and C7 /0: the immediate is as wide as the access, at most 32 bits.
            if (modrm >> 3) & 7 != 0 {
                return Err(DecodeError::Unsupported(opcode));
            }
            let width = usize::from(size.min(4));
            let imm = bytes.get(i..i + width).ok_or(DecodeError::Truncated)?;
            i += width;
            let mut le = [0u8; 4];
            le[..width].copy_from_slice(imm);
            Op::WriteImm {
                imm: u32::from_le_bytes(le),
            }
        }
    };
    if i > bytes.len() {
        return Err(DecodeError::Truncated);
    }
    Ok(Access {
        op,
        len: i,
        size,
        high_byte,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A0-A3: the accumulator and an absolute address, the offset as wide as the addresses.
    #[test]
    fn accumulator_moves_with_an_absolute_address() {
        // apic.flat's `mov eax, [0xfed40030]` in 64-bit mode.
        let a = decode(&[0xa1, 0x30, 0, 0xd4, 0xfe, 0, 0, 0, 0, 0x44], true).unwrap();
        assert_eq!((a.op, a.len, a.size), (Op::Read { reg: 0 }, 9, 4));
        let a = decode(&[0x48, 0xa3, 0, 0, 0, 0, 0, 0, 0, 0], true).unwrap();
        assert_eq!((a.op, a.len, a.size), (Op::Write { reg: 0 }, 10, 8));
        let a = decode(&[0x67, 0xa0, 0x30, 0, 0xe0, 0xfe], true).unwrap();
        assert_eq!(
            (a.op, a.len, a.size, a.high_byte),
            (Op::Read { reg: 0 }, 6, 1, false)
        );
        let a = decode(&[0x66, 0xa3, 0x80, 0, 0xe0, 0xfe], false).unwrap();
        assert_eq!((a.op, a.len, a.size), (Op::Write { reg: 0 }, 6, 2));
        assert_eq!(decode(&[0x67, 0xa1, 0x30, 0], false).unwrap().len, 4);
        assert_eq!(
            decode(&[0xa1, 0x30, 0, 0xd4], true),
            Err(DecodeError::Truncated)
        );
    }

    fn ok(bytes: &[u8]) -> Access {
        decode(bytes, true).unwrap()
    }

    #[test]
    fn the_moves_linux_makes() {
        // mov 0xffffffffff5fc0f0,%eax (absolute disp32 through SIB, no base).
        assert_eq!(
            ok(&[0x8b, 0x04, 0x25, 0xf0, 0xc0, 0x5f, 0xff]),
            Access {
                op: Op::Read { reg: 0 },
                len: 7,
                size: 4,
                high_byte: false
            }
        );
        // mov %edi,0xffffffffff5fc0b0.
        assert_eq!(
            ok(&[0x89, 0x3c, 0x25, 0xb0, 0xc0, 0x5f, 0xff]).op,
            Op::Write { reg: 7 }
        );
        // mov %r8d,(%rax) with REX.R; mov %eax,0x320(%rdx); mov 0x10(%rbx),%ecx.
        assert_eq!(
            ok(&[0x44, 0x89, 0x00]),
            Access {
                op: Op::Write { reg: 8 },
                len: 3,
                size: 4,
                high_byte: false
            }
        );
        assert_eq!(ok(&[0x89, 0x82, 0x20, 0x03, 0, 0]).len, 6);
        assert_eq!(
            ok(&[0x8b, 0x4b, 0x10]),
            Access {
                op: Op::Read { reg: 1 },
                len: 3,
                size: 4,
                high_byte: false
            }
        );
        // RIP-relative; REX.B only changes the base.
        assert_eq!(ok(&[0x8b, 0x05, 1, 2, 3, 4]).len, 6);
        assert_eq!(ok(&[0x41, 0x8b, 0x00]).op, Op::Read { reg: 0 });
        // movl $0x10000,0xffffffffff5fc380 (C7 /0 with disp32 and imm32).
        assert_eq!(
            ok(&[0xc7, 0x04, 0x25, 0x80, 0xc3, 0x5f, 0xff, 0, 0, 1, 0]),
            Access {
                op: Op::WriteImm { imm: 0x10000 },
                len: 11,
                size: 4,
                high_byte: false
            }
        );
        // A segment prefix and an SIB with base and index and disp8.
        assert_eq!(ok(&[0x65, 0x8b, 0x44, 0x88, 0x08]).len, 5);
        // Trailing bytes are the next instruction's.
        assert_eq!(ok(&[0x8b, 0x00, 0x90, 0x90]).len, 2);
    }

    #[test]
    fn other_sizes_of_move() {
        let access = |bytes: &[u8], long| {
            let a = decode(bytes, long).unwrap();
            (a.op, a.len, a.size, a.high_byte)
        };
        // kvm-unit-tests' memset: mov %sil,(%rcx) (REX without W: SIL, not DH).
        assert_eq!(
            access(&[0x40, 0x88, 0x31], true),
            (Op::Write { reg: 6 }, 3, 1, false)
        );
        // mov %dh,(%rcx) without REX; mov (%rax),%ah.
        assert_eq!(
            access(&[0x88, 0x31], true),
            (Op::Write { reg: 2 }, 2, 1, true)
        );
        assert_eq!(
            access(&[0x8a, 0x20], false),
            (Op::Read { reg: 0 }, 2, 1, true)
        );
        // mov (%rax),%r9b; movb $0xff,0x10(%rdx).
        assert_eq!(
            access(&[0x44, 0x8a, 0x08], true),
            (Op::Read { reg: 9 }, 3, 1, false)
        );
        assert_eq!(
            access(&[0xc6, 0x42, 0x10, 0xff], true),
            (Op::WriteImm { imm: 0xff }, 4, 1, false)
        );
        // 16 bits: mov %ax,(%rcx); movw $0x1234,(%rax).
        assert_eq!(
            access(&[0x66, 0x89, 0x01], true),
            (Op::Write { reg: 0 }, 3, 2, false)
        );
        assert_eq!(
            access(&[0x66, 0xc7, 0x00, 0x34, 0x12], true),
            (Op::WriteImm { imm: 0x1234 }, 5, 2, false)
        );
        // 64 bits: mov (%rax),%rcx; movq $-1,(%rax) (imm32, sign-extended); REX.W beats 66.
        assert_eq!(
            access(&[0x48, 0x8b, 0x08], true),
            (Op::Read { reg: 1 }, 3, 8, false)
        );
        assert_eq!(
            access(&[0x48, 0xc7, 0x00, 0xff, 0xff, 0xff, 0xff], true),
            (Op::WriteImm { imm: u32::MAX }, 7, 8, false)
        );
        assert_eq!(access(&[0x66, 0x48, 0x89, 0x00], true).2, 8);
    }

    #[test]
    fn what_is_not_a_move_is_refused() {
        assert_eq!(
            decode(&[0xf0, 0x01, 0x00], true),
            Err(DecodeError::Unsupported(0xf0))
        );
        assert_eq!(
            decode(&[0x87, 0x00], true),
            Err(DecodeError::Unsupported(0x87))
        );
        // rep stosb.
        assert_eq!(
            decode(&[0xf3, 0xaa], true),
            Err(DecodeError::Unsupported(0xf3))
        );
        assert_eq!(decode(&[0x89, 0xc0], true), Err(DecodeError::NotMemory));
        assert_eq!(
            decode(&[0xc7, 0x08, 0, 0, 0, 0], true),
            Err(DecodeError::Unsupported(0xc7))
        );
        assert_eq!(
            decode(&[0xc6, 0x00], true),
            Err(DecodeError::Truncated),
            "the imm8 is missing"
        );
        assert_eq!(decode(&[0x8b, 0x04], true), Err(DecodeError::Truncated));
        assert_eq!(
            decode(&[0x8b, 0x80, 0x20], true),
            Err(DecodeError::Truncated)
        );
        assert_eq!(decode(&[], true), Err(DecodeError::Truncated));
        // 0x41 is INC ECX outside 64-bit mode.
        assert_eq!(
            decode(&[0x41, 0x8b, 0x00], false),
            Err(DecodeError::Unsupported(0x41))
        );
    }

    proptest::proptest! {
        #[test]
        fn any_bytes_decode_or_refuse_within_bounds(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..20),
            long in proptest::prelude::any::<bool>(),
        ) {
            if let Ok(a) = decode(&bytes, long) {
                proptest::prop_assert!(a.len >= 2 && a.len <= bytes.len().min(MAX_LEN));
            }
        }
    }
}
