//! A caught exception, as the fault-tolerant accessors report it.

use core::fmt;

/// #UD, invalid opcode.
pub const UD: u8 = 6;
/// #GP, general protection.
pub const GP: u8 = 13;
/// #PF, page fault.
pub const PF: u8 = 14;

/// An exception raised by an instruction that was expected to fault.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fault {
    pub vector: u8,
}

impl Fault {
    pub const GP: Fault = Fault { vector: GP };
    pub const UD: Fault = Fault { vector: UD };
}

/// The mnemonic of an exception vector (SDM Vol. 3A Table 7-1), or `None` above 31.
pub const fn mnemonic(vector: u64) -> Option<&'static str> {
    Some(match vector {
        0 => "#DE",
        1 => "#DB",
        2 => "NMI",
        3 => "#BP",
        4 => "#OF",
        5 => "#BR",
        6 => "#UD",
        7 => "#NM",
        8 => "#DF",
        10 => "#TS",
        11 => "#NP",
        12 => "#SS",
        13 => "#GP",
        14 => "#PF",
        16 => "#MF",
        17 => "#AC",
        18 => "#MC",
        19 => "#XM",
        20 => "#VE",
        21 => "#CP",
        _ => return None,
    })
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match mnemonic(self.vector as u64) {
            Some(m) => f.write_str(m),
            None => write!(f, "vector {}", self.vector),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert_eq!(Fault::GP.to_string(), "#GP");
        assert_eq!(Fault::UD.to_string(), "#UD");
        assert_eq!(Fault { vector: 9 }.to_string(), "vector 9");
        assert_eq!(Fault { vector: 200 }.to_string(), "vector 200");
        assert_eq!(mnemonic(PF as u64), Some("#PF"));
    }
}
