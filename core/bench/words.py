"""Random real English words for synthetic prompts, as text or as token ids of a given tokenizer.

Words from a fixed list rather than random vocabulary ids: byte-pair vocabularies are full of word fragments
(``con``, ``pro``), and copy-heavy prompts should read like text for the model to copy it as a model copies text.
"""

from __future__ import annotations

import random

WORDS = (
    "the of and to in is that it was for on are with as his they be at one have this from or had by word but what "
    "some we can out other were all there when up use your how said an each she which do their time if will way about "
    "many then them write would like so these her long make thing see him two has look more day could go come did "
    "number sound no most people my over know water than call first who may down side been now find any new work part "
    "take get place made live where after back little only round man year came show every good me give our under name "
    "very through just form sentence great think say help low line differ turn cause much mean before move right boy "
    "old too same tell does set three want air well also play small end put home read hand port large spell add even "
    "land here must big high such follow act why ask men change went light kind off need house picture try us again "
    "animal point mother world near build self earth father head stand own page should country found answer school "
    "grow study still learn plant cover food sun four between state keep eye never last let thought city tree cross "
    "farm hard start might story saw far sea draw left late run while press close night real life few north open seem "
    "together next white children begin got walk example ease paper group always music those both mark often letter "
    "until mile river car feet care second book carry took science eat room friend began idea fish mountain stop once "
    "base hear horse cut sure watch color face wood main enough plain girl usual young ready above ever red list "
    "though feel talk bird soon body dog family direct pose leave song measure door product black short numeral class "
    "wind question happen complete ship area half rock order fire south problem piece told knew pass since top whole "
    "king space heard best hour better true during hundred five remember step early hold west ground interest reach "
    "fast verb sing listen six table travel less morning ten simple several vowel toward war lay against pattern slow "
    "center love person money serve appear road map rain rule govern pull cold notice voice unit power town fine "
    "certain fly fall lead cry dark machine note wait plan figure star box noun field rest correct able pound done "
    "beauty drive stood contain front teach week final gave green quick develop ocean warm free minute strong special "
    "mind behind clear tail produce fact street inch multiply nothing course stay wheel full force blue object decide "
    "surface deep moon island foot system busy test record boat common gold possible plane stead dry wonder laugh "
    "thousand ago ran check game shape equate miss brought heat snow tire bring yes distant fill east paint language "
    "among"
).split()


class WordSource:
    """Draws random words from ``WORDS`` with a caller-owned ``random.Random`` (so workloads stay seeded)."""

    def __init__(self, tokenizer, rng: random.Random):
        self.rng = rng
        # A leading space makes each word tokenize as it does mid-sentence.
        encoded = tokenizer([" " + word for word in WORDS], add_special_tokens=False)["input_ids"]
        self._word_token_ids = [list(ids) for ids in encoded]

    def token_ids(self, length: int) -> list[int]:
        """Exactly ``length`` token ids of random words (the last word may be cut)."""
        ids: list[int] = []
        while len(ids) < length:
            ids.extend(self.rng.choice(self._word_token_ids))
        return ids[:length]

    def bulk_token_ids(self, length: int) -> list[int]:
        """Like ``token_ids`` (another draw of the same kind), several times faster: for workloads of 100,000
        requests."""
        ids: list[int] = []
        while len(ids) < length:
            for word in self.rng.choices(self._word_token_ids, k=length - len(ids)):
                ids.extend(word)
        return ids[:length]

    def passage(self, num_words: int) -> str:
        """``num_words`` random words as capitalized sentences of 6 to 14 words."""
        sentences = []
        remaining = num_words
        while remaining > 0:
            count = min(remaining, self.rng.randint(6, 14))
            words = [self.rng.choice(WORDS) for _ in range(count)]
            sentences.append(" ".join(words).capitalize() + ".")
            remaining -= count
        return " ".join(sentences)
