"""Fakes shared by the tests: a one-character-per-token tokenizer and an
engine whose logits follow a script (no model, no torch forward)."""
import time

import torch

LETTERS = "abcdefghijklmnopqrstuvwxyz"
END_ID = 0
VOCAB = 1 + len(LETTERS) + 1  # end id, letters, space


class FakeTokenizer:
    """One token per character: 0 is the end of sequence, then a-z and ' '."""

    eos_token_id = END_ID
    chat_template = None
    alphabet = "\0" + LETTERS + " "

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [self.alphabet.index(c) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.alphabet[i] for i in ids if i != END_ID or not skip_special_tokens)


def next_letter(ids):
    """a -> b -> ... -> z -> a, as token ids."""
    return ids[-1] % len(LETTERS) + 1


class FakeEngine:
    """Logits peaked at `script(ids)` (10), the letter after it second (5).

    Records every step's rows, the most sequences active at once and every
    release; `delay` seconds of sleep per step stand in for the forward."""

    vocab_size = VOCAB

    def __init__(self, max_batch_size=4, max_context=64, script=next_letter, delay=0.0):
        self.max_batch_size, self.max_context = max_batch_size, max_context
        self.script, self.delay = script, delay
        self.ids, self.most_active, self.released, self.steps = {}, 0, [], []

    def add(self, seq_id, prompt_ids, max_tokens=None):
        assert len(self.ids) < self.max_batch_size
        self.ids[seq_id] = list(prompt_ids)
        self.most_active = max(self.most_active, len(self.ids))

    def step(self, seq_ids):
        time.sleep(self.delay)
        self.steps.append(list(seq_ids))
        logits = torch.full((len(seq_ids), VOCAB), -10.0)
        for row, seq_id in enumerate(seq_ids):
            target = self.script(self.ids[seq_id])
            logits[row, target] = 10.0
            logits[row, next_letter([target])] = 5.0
        return logits

    def append(self, seq_ids, token_ids):
        for seq_id, token in zip(seq_ids, token_ids):
            self.ids[seq_id].append(token)

    def release(self, seq_id):
        self.released.append(seq_id)
        del self.ids[seq_id]

    def length(self, seq_id):
        return len(self.ids[seq_id])
