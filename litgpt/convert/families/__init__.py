"""What each Hugging Face architecture is, in litgpt's terms: its config fields and one weight-name map.

The same map is read in both directions (Hugging Face -> litgpt and back), so the two converters cannot drift apart.
A family is a set of `Config` values that its Hugging Face class hard-codes; everything else is read from, and written
to, `config.json`. One concern per module:

- `family`: what a family is (`Family`), the values every family shares, helpers every config reader needs;
- `catalogue`: every supported family by model_type (`family_of`);
- `configs`: config.json <-> `Config`, both ways (`config_from_hf`, `config_to_hf`);
- `weights`: the weight-name map and its rules (`weight_rules`, `Rule`);
- `legacy`: Falcon, StableLM, phi-1.5/2 and OLMo 1, and the fused q/k/v layouts of Falcon and GPT-NeoX;
- `deepseek`: DeepSeek-style mixtures of experts (DeepSeek-V2/V3, Kimi K2, GLM-4.5) and multi-head latent attention.
"""
