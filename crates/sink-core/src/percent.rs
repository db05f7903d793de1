//! Percent-decoding of a broker URL's parts (user, password, token,
//! virtual host), strictly: the `url` crate keeps a stray `%` as it is,
//! where a typo in a password must be an error, not a different password.

/// `s` percent-decoded; `None` for a malformed escape (`%` not followed by
/// two hex digits) or bytes that are not UTF-8.
pub fn decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let malformed = bytes.iter().enumerate().any(|(i, &b)| {
        b == b'%'
            && !bytes
                .get(i + 1..i + 3)
                .is_some_and(|h| h.iter().all(u8::is_ascii_hexdigit))
    });
    if malformed {
        return None;
    }
    percent_encoding::percent_decode_str(s)
        .decode_utf8()
        .ok()
        .map(|c| c.into_owned())
}

#[cfg(test)]
mod tests {
    use super::decode;

    #[test]
    fn only_well_formed_utf8_escapes_decode() {
        assert_eq!(decode("p%40ss%2Fw").as_deref(), Some("p@ss/w"));
        assert_eq!(decode("plain").as_deref(), Some("plain"));
        for bad in ["%", "a%4", "a%zz", "%ff", "100%"] {
            assert_eq!(decode(bad), None, "{bad}");
        }
    }
}
