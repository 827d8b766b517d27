//! Writes the word-level language model's training examples (see `word_features`) as CSV.
//!
//! Run: `cargo run -p dflow-examples --example wordlm_data -- examples/data/shakespeare.txt.gz wordlm.csv`

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [input, output] = args.as_slice() else {
        return Err("usage: wordlm_data TEXT[.gz] OUT.csv".into());
    };
    let text = dflow::executor::data::text::read_text(input)?;
    let tokens = dflow_examples::word_features::tokens(&text);
    let examples = dflow_examples::word_features::examples(&tokens);
    std::fs::write(output, dflow_examples::word_features::to_csv(&examples))?;
    let distinct: std::collections::HashSet<&String> = tokens.iter().collect();
    eprintln!(
        "{input}: {} tokens, {} distinct words; {} examples written to {output} ({} hashed table rows, {} classes)",
        tokens.len(),
        distinct.len(),
        examples.len(),
        dflow_examples::word_features::TABLE_ROWS,
        dflow_examples::word_features::OUTPUT_WORDS
    );
    Ok(())
}
