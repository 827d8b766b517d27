//! Word-level language-model features from a text (the `examples/wordlm` workload): each word
//! is predicted from the two words before it.
//!
//! The text is lower-cased and cut into tokens: runs of letters and apostrophes, and every other
//! non-space character on its own. The eleven plays of `examples/data/shakespeare.txt.gz` hold
//! about 350,000 tokens of about 15,000 distinct words, fewer than the 20,000 rows the workload
//! wants in its embedding table, so the inputs are hashed features (as a recommendation model
//! hashes its sparse features): for the word at position t, the previous word, the word before
//! it, and the bigram of the two, each hashed (64-bit FNV-1a, with distinct prefixes) into
//! [`TABLE_ROWS`] rows. The target is the word's id among the [`OUTPUT_WORDS`] − 1 most frequent
//! words (ties in byte order), or [`OUTPUT_WORDS`] − 1 (`<unk>`) for any other word.

use std::collections::HashMap;

/// Rows of the hashed embedding table.
pub const TABLE_ROWS: u64 = 20_480;
/// Classes of the output: the most frequent words and `<unk>`.
pub const OUTPUT_WORDS: usize = 2_000;
/// Features per example.
pub const FEATURES: usize = 3;

/// The tokens of `text` (see the module docs).
pub fn tokens(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut word = String::new();
    for c in text.chars().flat_map(char::to_lowercase) {
        if c.is_alphabetic() || c == '\'' {
            word.push(c);
            continue;
        }
        if !word.is_empty() {
            out.push(std::mem::take(&mut word));
        }
        if !c.is_whitespace() {
            out.push(c.to_string());
        }
    }
    if !word.is_empty() {
        out.push(word);
    }
    out
}

/// 64-bit FNV-1a of `parts` joined by a space, modulo [`TABLE_ROWS`].
pub fn hashed(parts: &[&str]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for (i, p) in parts.iter().enumerate() {
        if i > 0 {
            h ^= u64::from(b' ');
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        for b in p.bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h % TABLE_ROWS
}

/// One example per token from the third on: the hashed features of the two tokens before it
/// and the target class.
pub fn examples(tokens: &[String]) -> Vec<([u64; FEATURES], usize)> {
    let mut counts: HashMap<&str, usize> = HashMap::new();
    for t in tokens {
        *counts.entry(t.as_str()).or_insert(0) += 1;
    }
    let mut by_count: Vec<(&str, usize)> = counts.into_iter().collect();
    by_count.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
    let unk = OUTPUT_WORDS - 1;
    let class: HashMap<&str, usize> = by_count
        .iter()
        .take(unk)
        .enumerate()
        .map(|(i, (w, _))| (*w, i))
        .collect();
    tokens
        .windows(3)
        .map(|w| {
            let (a, b) = (w[0].as_str(), w[1].as_str());
            let features = [
                hashed(&["prev", b]),
                hashed(&["prev2", a]),
                hashed(&["bigram", a, b]),
            ];
            (features, class.get(w[2].as_str()).copied().unwrap_or(unk))
        })
        .collect()
}

/// The examples as CSV lines `f1,f2,f3,class` (the format `dflow run --data` reads).
pub fn to_csv(examples: &[([u64; FEATURES], usize)]) -> String {
    let mut out = String::with_capacity(examples.len() * 24);
    for (f, c) in examples {
        out.push_str(&format!("{},{},{},{c}\n", f[0], f[1], f[2]));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_split_words_and_punctuation() {
        assert_eq!(
            tokens("To be, or NOT to be: that's it."),
            ["to", "be", ",", "or", "not", "to", "be", ":", "that's", "it", "."]
        );
    }

    #[test]
    fn examples_hash_context_into_the_table_and_classify_the_next_word() {
        let t = tokens("a b a b a c");
        let ex = examples(&t);
        assert_eq!(ex.len(), 4);
        // a, b are the most frequent (3 and 2), then c.
        assert_eq!(ex.iter().map(|e| e.1).collect::<Vec<_>>(), [0, 1, 0, 2]);
        assert_eq!(ex[0].0, ex[2].0, "the same context hashes the same");
        assert!(ex.iter().all(|(f, _)| f.iter().all(|&h| h < TABLE_ROWS)));
        assert_ne!(hashed(&["prev", "a"]), hashed(&["prev2", "a"]));
    }
}
