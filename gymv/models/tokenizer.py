"""Train a byte-level BPE tokenizer on the fly, so that a tiny model needs nothing from a hub.

Byte-level BPE can encode any text (no unknown tokens), which matters when an environment inserts text the
corpus never saw. Chat markers and vision tokens are special tokens; tool-call markup is added as whole
(non-special) tokens so that decoding with `skip_special_tokens=True` keeps it for the tool-call parser.
"""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from gymv.models.corpus import SPECIAL_TEXT, build_corpus

PAD, EOS, IM_START, IM_END = "<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHAT_SPECIALS = [PAD, EOS, IM_START, IM_END]


def train_bpe(seed: int, vocab_size: int, vision_tokens: list[str]) -> Tokenizer:
    """Return a trained `tokenizers.Tokenizer` whose first ids are the chat specials, then `vision_tokens`."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    specials = CHAT_SPECIALS + list(vision_tokens)
    budget = vocab_size - len(SPECIAL_TEXT)
    trainer = trainers.BpeTrainer(
        vocab_size=budget,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(build_corpus(seed), trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in SPECIAL_TEXT])
    return tok


def hf_tokenizer(tok: Tokenizer, *, image_token: str | None, extra: dict[str, str] | None = None):
    """Wrap a trained tokenizer as a transformers fast tokenizer that AutoTokenizer reloads as-is.

    `image_token` None: a text-only model's tokenizer, with no named vision tokens at all."""
    from transformers import PreTrainedTokenizerFast

    named = ({"image_token": image_token} if image_token else {}) | dict(extra or {})
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=IM_END,
        extra_special_tokens=named,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
