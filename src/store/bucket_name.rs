//! A bucket name as the memory store keeps it: in a fixed size, with no allocation of its own
//! (docs/performance.md, "Memory per bucket").
//!
//! The proxy names a bucket `<scope>:<label>:<digest>`, the digest 64 lowercase hex digits
//! (`key.rs`). The memory store keeps such a name as the digest's 32 bytes and a number that
//! stands for the `<scope>:<label>` text, which all the buckets of one limit share: [`Names`]
//! holds each text once per shard, for as long as a bucket uses it. Any other name
//! (`<scope>:global`, one a test makes up) is held whole in [`Names`] instead, with no digest.
//! Either way two buckets have one key only when their names are equal: the split is exact,
//! never a hash standing in for a name.

use std::hash::{BuildHasher, Hasher};

use hashbrown::HashTable;

/// The memory store's hasher. Bucket names are hashed on every request, and SipHash cost more
/// than the rest of the lookup. foldhash is seeded per process like std's hasher, and a
/// bucket's name ends in a SHA-256 or HMAC digest, so a client cannot line up colliding names.
pub(super) type RandomState = foldhash::fast::RandomState;

/// Bytes of a digest, and hex digits of its text.
pub(super) const DIGEST_LEN: usize = 32;
const DIGEST_HEX: usize = 2 * DIGEST_LEN;

/// One increment's bucket name, split and hashed once, before its shard is locked.
#[derive(Debug, Clone, Copy)]
pub(super) struct BucketName<'a> {
    /// `<scope>:<label>` (without the `:` before the digest), or the whole name.
    pub text: &'a str,
    /// The digest's bytes; zeros for a name held whole.
    pub digest: [u8; DIGEST_LEN],
    /// `text` is the whole name: it does not end in a digest.
    pub whole: bool,
    /// [`key_hash`] of the two: picks the shard and the place in its index.
    pub hash: u64,
}

impl<'a> BucketName<'a> {
    #[inline(always)]
    pub fn parse(bucket: &'a str, hasher: &RandomState) -> Self {
        let bytes = bucket.as_bytes();
        let mut name = BucketName {
            text: bucket,
            digest: [0; DIGEST_LEN],
            whole: true,
            hash: 0,
        };
        if let Some(at) = bytes.len().checked_sub(DIGEST_HEX + 1) {
            let hex = <&[u8; DIGEST_HEX]>::try_from(&bytes[at + 1..]);
            if let (b':', Ok(hex)) = (bytes[at], hex) {
                if decode_digest(hex, &mut name.digest) {
                    // `at` is the byte of an ASCII `:`, so a character boundary.
                    name.text = &bucket[..at];
                    name.whole = false;
                } else {
                    name.digest = [0; DIGEST_LEN];
                }
            }
        }
        name.hash = key_hash(hasher, name.text, (!name.whole).then_some(&name.digest));
        name
    }
}

/// The hash of a bucket's key: its text and its digest (if it has one). The hasher is seeded
/// per process, so a client cannot pick digests that pile up in one place of the index.
#[inline]
pub(super) fn key_hash(hasher: &RandomState, text: &str, digest: Option<&[u8; DIGEST_LEN]>) -> u64 {
    let mut h = hasher.build_hasher();
    h.write(text.as_bytes());
    if let Some(digest) = digest {
        // Two 16-byte words: two multiplications in foldhash, where `write` of the 32 bytes
        // takes its slice loop (15 fewer instructions per increment).
        let (low, high) = digest.split_at(DIGEST_LEN / 2);
        for half in [low, high] {
            h.write_u128(u128::from_le_bytes(half.try_into().unwrap_or_default()));
        }
    }
    h.finish()
}

/// Decodes `hex` (64 lowercase hex digits, as `BucketHasher::digest_into` writes them) into
/// `out`; false if it is anything else (`out` then holds garbage). It runs on every
/// increment: written as two plain loops over the digits without an early exit, so that the
/// compiler turns them into vector instructions (about 100 instructions per digest, against
/// 320 for eight digits at a time in a `u64`).
#[inline]
fn decode_digest(hex: &[u8; DIGEST_HEX], out: &mut [u8; DIGEST_LEN]) -> bool {
    let mut nibbles = [0u8; DIGEST_HEX];
    let mut bad = 0u8;
    for (nibble, &c) in nibbles.iter_mut().zip(hex) {
        let digit = c.wrapping_sub(b'0');
        let letter = c.wrapping_sub(b'a');
        let (is_digit, is_letter) = (digit < 10, letter < 6);
        *nibble = if is_digit {
            digit
        } else {
            letter.wrapping_add(10)
        };
        bad |= u8::from(!(is_digit | is_letter));
    }
    // Indexes rather than `chunks_exact(2)`, which compiled to a shuffle per byte here.
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = (nibbles[2 * i] << 4) | nibbles[2 * i + 1];
    }
    bad == 0
}

/// The texts a shard's buckets are named under, each held once for all the buckets that use
/// it, by a `u32` id. An entry lives while a bucket uses it, so there are never more entries
/// in use than buckets; a freed id is given out again first.
pub(super) struct Names {
    entries: Vec<NameEntry>,
    free: Vec<u32>,
    index: HashTable<u32>,
    hasher: RandomState,
}

struct NameEntry {
    text: Box<str>,
    /// A whole name (no digest follows), rather than a `<scope>:<label>` prefix.
    whole: bool,
    /// Buckets using it; 0: free, `text` empty.
    uses: u32,
}

impl NameEntry {
    #[inline]
    fn is(&self, text: &str, whole: bool) -> bool {
        self.whole == whole && same_text(self.text.as_bytes(), text.as_bytes())
    }
}

/// `a == b`, inline: every look-up compares its name's text (a limit's `<scope>:<label>`, a
/// few dozen bytes), and the call to `memcmp` that `==` makes, with the registers saved
/// around it, cost about 20 instructions more than comparing eight bytes at a time here.
#[inline]
fn same_text(a: &[u8], b: &[u8]) -> bool {
    let n = a.len();
    if n != b.len() {
        return false;
    }
    if n < 8 {
        return a.iter().zip(b).all(|(x, y)| x == y);
    }
    let word =
        |s: &[u8], at: usize| u64::from_le_bytes(s[at..at + 8].try_into().unwrap_or_default());
    // Whole words, then the last eight bytes (overlapping the last word when `n` is not a
    // multiple of eight).
    (0..n / 8).all(|i| word(a, 8 * i) == word(b, 8 * i)) && word(a, n - 8) == word(b, n - 8)
}

impl Names {
    pub fn new(hasher: RandomState) -> Self {
        Names {
            entries: Vec::new(),
            free: Vec::new(),
            index: HashTable::new(),
            hasher,
        }
    }

    /// Whether `id` stands for `name`'s text.
    pub fn is(&self, id: u32, name: &BucketName<'_>) -> bool {
        self.entries[id as usize].is(name.text, name.whole)
    }

    /// The text `id` stands for.
    pub fn text(&self, id: u32) -> &str {
        &self.entries[id as usize].text
    }

    /// Whether `id` stands for a whole name (no digest follows it).
    pub fn is_whole(&self, id: u32) -> bool {
        self.entries[id as usize].whole
    }

    /// Names in use (tests).
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// The id of `name`'s text, made if no bucket uses it yet; one more use.
    pub fn acquire(&mut self, name: &BucketName<'_>) -> u32 {
        let (text, whole) = (name.text, name.whole);
        let hash = self.hasher.hash_one(text);
        let Names {
            entries,
            free,
            index,
            hasher,
        } = self;
        if let Some(&id) = index.find(hash, |&id| entries[id as usize].is(text, whole)) {
            entries[id as usize].uses += 1;
            return id;
        }
        let entry = NameEntry {
            text: text.into(),
            whole,
            uses: 1,
        };
        let id = match free.pop() {
            Some(id) => {
                entries[id as usize] = entry;
                id
            }
            None => {
                entries.push(entry);
                // At most one entry per bucket, and a shard holds fewer than `u32::MAX`.
                (entries.len() - 1) as u32
            }
        };
        let entries = &*entries;
        index.insert_unique(hash, id, |&id| hasher.hash_one(&*entries[id as usize].text));
        id
    }

    /// One use of `id` fewer; the text is dropped with its last use.
    pub fn release(&mut self, id: u32) {
        let entry = &mut self.entries[id as usize];
        entry.uses -= 1;
        if entry.uses > 0 {
            return;
        }
        let hash = self.hasher.hash_one(&*entry.text);
        entry.text = Box::default();
        if let Ok(found) = self.index.find_entry(hash, |&other| other == id) {
            found.remove();
        }
        self.free.push(id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hasher() -> RandomState {
        RandomState::default()
    }

    #[test]
    fn a_digest_name_splits_into_its_prefix_and_digest_bytes() {
        let digest: [u8; 32] = std::array::from_fn(|i| (i * 37 + 5) as u8);
        let text = format!("api:x-api-key:{}", hex::encode(digest));
        let name = BucketName::parse(&text, &hasher());
        assert_eq!(
            (name.text, name.digest, name.whole),
            ("api:x-api-key", digest, false)
        );
    }

    #[test]
    fn other_names_are_held_whole() {
        let hex = "ab".repeat(32);
        for whole in [
            "api:global".to_string(),
            "b17".to_string(),
            String::new(),
            hex.clone(),                      // no `:` before the digits
            format!("p;{hex}"),               // another separator
            format!("p:{}", "AB".repeat(32)), // upper case: not what key.rs writes
            format!("p:{}", &hex[1..]),       // 63 digits
            format!("p:{hex}0"),              // 65 digits
            format!("p:{}g", &hex[1..]),      // not a digit
            format!("p:{}é", &hex[2..]),      // not ASCII
        ] {
            let name = BucketName::parse(&whole, &hasher());
            assert_eq!(
                (name.text, name.digest, name.whole),
                (whole.as_str(), [0; 32], true),
                "{whole}"
            );
        }
        // Exactly a `:` and 64 digits: an empty prefix.
        let bare = format!(":{hex}");
        assert_eq!(BucketName::parse(&bare, &hasher()).text, "");
    }

    /// The decoder against a plain one, for every byte value at every place of a digest.
    #[test]
    fn digits_decode_like_a_plain_decoder() {
        let plain = |digits: &[u8]| -> Option<[u8; 32]> {
            let nibble = |c: u8| match c {
                b'0'..=b'9' => Some(c - b'0'),
                b'a'..=b'f' => Some(c - b'a' + 10),
                _ => None,
            };
            let mut out = [0u8; 32];
            for (o, pair) in out.iter_mut().zip(digits.chunks_exact(2)) {
                *o = (nibble(pair[0])? << 4) | nibble(pair[1])?;
            }
            Some(out)
        };
        let base = *b"0123456789abcdef9f8e7d6c5b4a3021fedcba98765432100a1b2c3d4e5f6978";
        assert!(plain(&base).is_some());
        for place in 0..64 {
            for byte in 0..=255u8 {
                let mut digits = base;
                digits[place] = byte;
                let mut out = [0u8; 32];
                let decoded = decode_digest(&digits, &mut out).then_some(out);
                assert_eq!(decoded, plain(&digits), "{digits:?}");
            }
        }
    }

    #[test]
    fn texts_compare_like_slices() {
        let texts: Vec<Vec<u8>> = (0..40)
            .map(|n| (0..n).map(|i| b'a' + (i % 7) as u8).collect())
            .collect();
        for a in &texts {
            for b in &texts {
                assert_eq!(same_text(a, b), a == b);
            }
            // One byte changed anywhere.
            for at in 0..a.len() {
                let mut c = a.clone();
                c[at] ^= 1;
                assert!(!same_text(a, &c), "{a:?} {at}");
            }
        }
    }

    #[test]
    fn a_name_lives_while_a_bucket_uses_it_and_its_id_is_reused() {
        let hasher = hasher();
        let mut names = Names::new(hasher.clone());
        let digest = "0".repeat(64);
        let (a, b) = (format!("a:{digest}"), format!("b:{digest}"));
        let first = names.acquire(&BucketName::parse(&a, &hasher));
        assert_eq!(names.acquire(&BucketName::parse(&a, &hasher)), first);
        // `a` whole is another name than the prefix `a`.
        let whole = names.acquire(&BucketName::parse("a", &hasher));
        assert_ne!(whole, first);
        assert_eq!(names.len(), 2);
        names.release(first);
        assert_eq!(names.text(first), "a", "one use left");
        names.release(first);
        names.release(whole);
        assert_eq!(names.len(), 0);
        let again = names.acquire(&BucketName::parse(&b, &hasher));
        assert!(again == first || again == whole, "a freed id is reused");
        assert!(names.is(again, &BucketName::parse(&b, &hasher)));
        assert_eq!(names.entries.len(), 2);
    }
}
