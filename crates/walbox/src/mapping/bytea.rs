//! A `bytea` column's text form back to its bytes: pgoutput (in text mode)
//! and walbox's own `::text` copies write `bytea` with the server's
//! `bytea_output`: `hex` (`\x0a1b…`, the default) or `escape` (printable
//! bytes as they are, a backslash as `\\`, any other byte as `\ooo` in
//! octal). Both are read, whatever the server or the role sets; anything
//! else is an error, never a panic.

/// Why a value is not `bytea` text.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("not bytea text ({0})")]
pub struct NotBytea(&'static str);

/// Decodes `text`, in either output format, into the bytes it stands for.
pub fn decode(text: &[u8]) -> Result<Vec<u8>, NotBytea> {
    match text.strip_prefix(b"\\x") {
        Some(hex) => decode_hex(hex),
        None => decode_escape(text),
    }
}

fn decode_hex(hex: &[u8]) -> Result<Vec<u8>, NotBytea> {
    if hex.len() % 2 != 0 {
        return Err(NotBytea("an odd number of hex digits"));
    }
    let digit = |c: u8| match c {
        b'0'..=b'9' => Ok(c - b'0'),
        b'a'..=b'f' => Ok(c - b'a' + 10),
        b'A'..=b'F' => Ok(c - b'A' + 10),
        _ => Err(NotBytea("a character that is not a hex digit")),
    };
    hex.chunks_exact(2)
        .map(|pair| Ok(digit(pair[0])? << 4 | digit(pair[1])?))
        .collect()
}

fn decode_escape(text: &[u8]) -> Result<Vec<u8>, NotBytea> {
    let mut out = Vec::with_capacity(text.len());
    let mut rest = text;
    while let Some((&b, tail)) = rest.split_first() {
        if b != b'\\' {
            out.push(b);
            rest = tail;
            continue;
        }
        match tail {
            [b'\\', after @ ..] => {
                out.push(b'\\');
                rest = after;
            }
            [a @ b'0'..=b'3', b @ b'0'..=b'7', c @ b'0'..=b'7', after @ ..] => {
                out.push((a - b'0') << 6 | (b - b'0') << 3 | (c - b'0'));
                rest = after;
            }
            _ => return Err(NotBytea("a backslash that starts no escape")),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_both_output_formats() {
        assert_eq!(decode(b"\\x").unwrap(), b"");
        assert_eq!(decode(b"\\x00ff7F0a").unwrap(), [0, 255, 127, 10]);
        assert_eq!(decode(b"").unwrap(), b"");
        assert_eq!(decode(b"ab\\\\c\\000\\377").unwrap(), b"ab\\c\x00\xff");
        // Every byte, as Postgres's escape format writes it.
        let all: Vec<u8> = (0..=255).collect();
        let mut escaped = Vec::new();
        for &b in &all {
            match b {
                b'\\' => escaped.extend_from_slice(b"\\\\"),
                0x20..=0x7e => escaped.push(b),
                _ => escaped.extend_from_slice(format!("\\{b:03o}").as_bytes()),
            }
        }
        assert_eq!(decode(&escaped).unwrap(), all);
        let hex: String = all.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(decode(format!("\\x{hex}").as_bytes()).unwrap(), all);
    }

    #[test]
    fn refuses_what_no_format_writes_without_panicking() {
        for bad in [
            &b"\\x0"[..],
            b"\\xzz",
            b"\\x\xff\xff",
            b"a\\",
            b"\\9",
            b"\\47",
            b"\\400",
        ] {
            assert!(decode(bad).is_err(), "{bad:?}");
        }
    }
}
