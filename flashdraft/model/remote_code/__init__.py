"""Code written beside exported drafters: `dflash.py` (self-contained, torch + transformers only) for
`AutoModel.from_pretrained(path, trust_remote_code=True)`. Not imported by flashdraft itself."""
