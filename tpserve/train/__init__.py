"""Training tools: the demo target (``tpserve.train.target``) and EAGLE-3 drafts
(``tpserve.train.eagle3``). Optional extra: ``pip install -e ".[train]"``."""
