"""The compressed-tensors format on the real models: SmolLM2-135M written with `--bits 4`
(576-wide inputs take group 64, the 1536-wide down_proj group 128) loads in transformers with
logits equal to our dequantized model's; all-MiniLM-L6-v2 (a BertModel) loads through AutoModel
with our hidden states. Needs data/ from scripts/prepare_data.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from devtools.quality import MINILM_DIR, NEWS_FILE, SMOLLM_DIR, data_ready
from higgs_engine.ct.writer import uniform_assignment, write_compressed_tensors
from tests.engine.test_ct import reference_model

READY, WHY = data_ready()
pytestmark = [
    pytest.mark.realdata,
    pytest.mark.slow,
    pytest.mark.skipif(not READY, reason=WHY),
    pytest.mark.timeout(2400),
]


def test_smollm2_bits_4_loads_in_transformers_with_our_logits(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = Path(SMOLLM_DIR)
    assignment = uniform_assignment(source, 4)
    result = write_compressed_tensors(source, assignment, tmp_path / "ct")
    assert result["schemes"] == {"w4a16-g128": 30, "w4a16-g64": 180}
    assert result["kept"] == {}
    assert 4.2 < result["bits_per_weight"] < 4.3  # fp16 scale per 64 (or 128) weights
    assert (tmp_path / "ct" / "chat_template.jinja").is_file()

    tok = AutoTokenizer.from_pretrained(str(tmp_path / "ct"))
    ids = tok(NEWS_FILE.read_text()[:2000], return_tensors="pt").input_ids[:, :64]
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ct")).eval()
    ref = reference_model(source, assignment, torch.float16)
    with torch.no_grad():
        got = loaded(ids).logits.float()
        want = ref(ids).logits.float()
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.29.mlp.down_proj"):
        key = f"{name}.weight"
        assert torch.equal(loaded.state_dict()[key], ref.state_dict()[key]), key
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


def test_minilm_bits_4_loads_through_automodel(tmp_path: Path) -> None:
    from transformers import AutoModel

    source = Path(MINILM_DIR)
    assignment = uniform_assignment(source, 4)
    result = write_compressed_tensors(source, assignment, tmp_path / "ct")
    assert result["schemes"] == {"w4a16-g128": 37}  # 384 and 1536 wide: group 128 everywhere
    loaded = AutoModel.from_pretrained(str(tmp_path / "ct")).eval()
    ref = reference_model(source, assignment, torch.float16, AutoModel)
    ids = torch.randint(1000, 20000, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = loaded(input_ids=ids).last_hidden_state.float()
        want = ref(input_ids=ids).last_hidden_state.float()
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
