"""Which shapes/dtypes compiled flex_attention lowers for on this GPU (prints one line each)."""

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

flex = torch.compile(flex_attention, dynamic=False)
for dtype, d, q_len, kv_len in [(torch.float32, 16, 103, 576), (torch.float32, 16, 128, 640),
                                (torch.bfloat16, 16, 103, 576), (torch.bfloat16, 64, 103, 576),
                                (torch.bfloat16, 64, 128, 1024)]:
    q = torch.randn(1, 4, q_len, d, device="cuda", dtype=dtype)
    k = torch.randn(1, 2, kv_len, d, device="cuda", dtype=dtype)
    bm = create_block_mask(lambda b, h, qi, ki: ki <= qi, None, None, q_len, kv_len,
                           device="cuda", BLOCK_SIZE=128)
    try:
        flex(q, k, k, block_mask=bm, enable_gqa=True)
        print("flex_probe ok", dtype, d, q_len, kv_len)
    except Exception as e:
        print("flex_probe FAIL", dtype, d, q_len, kv_len, type(e).__name__, str(e)[:120])
