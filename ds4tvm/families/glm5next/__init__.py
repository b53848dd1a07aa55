"""GLM-5.3-Flash (`glm5-next`, ds4-spec §1.4 and §4): so far its config and tensor table in both
GGUF layouts (ds4's and llama.cpp's), a random-model writer and the published shapes. It has no
`FAMILY` entry in the registry yet: the graph (KDA, DSA, mHC, MoE) and the MTP drafter come next,
and a GLM file is refused as an unsupported architecture until they do."""
