//! The one piece of ACPI AML the hypervisor reads without an interpreter: the `\\_S5_` object,
//! which gives the sleep-type values for power-off. The DSDT is firmware input: a malformed or
//! truncated one yields `None`, never a fault.

/// Finds the `\_S5_` sleep-type values in a DSDT's AML without an AML interpreter: the object is
/// always `Name(_S5, Package(){SLP_TYPa, SLP_TYPb, ...})` (ACPI 6.5 §7.4.2), encoded as
/// NameOp (08), optional root prefix (5C), "_S5_", PackageOp (12), PkgLength, NumElements, then
/// integers as ZeroOp (00), OneOp (01) or BytePrefix (0A) nn (ACPI 6.5 §20.2).
pub fn find_s5(aml: &[u8]) -> Option<(u8, u8)> {
    let at = aml.windows(4).position(|w| w == b"_S5_")?;
    let name_op = match at.checked_sub(1).map(|i| aml[i]) {
        Some(0x08) => true,
        Some(0x5c) => at >= 2 && aml[at - 2] == 0x08,
        _ => false,
    };
    if !name_op {
        return None;
    }
    let mut i = at + 4;
    if *aml.get(i)? != 0x12 {
        return None;
    }
    i += 1;
    // PkgLength: bits 7:6 of the lead byte count the bytes that follow (ACPI 6.5 §20.2.4).
    i += 1 + ((*aml.get(i)? >> 6) as usize);
    i += 1; // NumElements
    let int = |i: &mut usize| -> Option<u8> {
        match *aml.get(*i)? {
            0x00 => {
                *i += 1;
                Some(0)
            }
            0x01 => {
                *i += 1;
                Some(1)
            }
            0x0a => {
                let v = *aml.get(*i + 1)?;
                *i += 2;
                Some(v)
            }
            _ => None,
        }
    };
    let a = int(&mut i)?;
    let b = int(&mut i).unwrap_or(0);
    Some((a, b))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn bochs_and_qemu_encodings() {
        // Name(\_S5, Package(4){0, 0, 0, 0}) as iasl emits it with ZeroOps.
        let mut aml = vec![
            0x10, 0x20, 0x08, 0x5c, b'_', b'S', b'5', b'_', 0x12, 0x06, 0x04,
        ];
        aml.extend([0x00, 0x00, 0x00, 0x00]);
        assert_eq!(find_s5(&aml), Some((0, 0)));
        // Name(_S5, Package(){0x05, 0x05}) with BytePrefix.
        let aml = [
            0x08, b'_', b'S', b'5', b'_', 0x12, 0x08, 0x02, 0x0a, 0x05, 0x0a, 0x07,
        ];
        assert_eq!(find_s5(&aml), Some((5, 7)));
        // Two-byte PkgLength, OneOp.
        let aml = [
            0x08, b'_', b'S', b'5', b'_', 0x12, 0x40, 0x01, 0x02, 0x01, 0x00,
        ];
        assert_eq!(find_s5(&aml), Some((1, 0)));
    }

    #[test]
    fn not_a_name_or_truncated() {
        assert_eq!(find_s5(b"_S5_"), None);
        assert_eq!(
            find_s5(&[0x14, b'_', b'S', b'5', b'_', 0x12, 0x06, 0x04, 0x00]),
            None
        );
        assert_eq!(find_s5(&[0x08, b'_', b'S', b'5', b'_', 0x12]), None);
        assert_eq!(
            find_s5(&[0x08, b'_', b'S', b'5', b'_', 0x12, 0xc0, 0x01]),
            None
        );
    }

    proptest! {
        #[test]
        fn never_panics(aml in prop::collection::vec(any::<u8>(), 0..64), at in 0usize..64) {
            let mut aml = aml;
            let at = at.min(aml.len());
            aml.splice(at..at, [0x08, b'_', b'S', b'5', b'_']);
            let _ = find_s5(&aml);
        }
    }
}
