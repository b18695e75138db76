"""Chapter 11: a German-English translator from the course's Transformer: data, subwords, training, decoding, scores."""
