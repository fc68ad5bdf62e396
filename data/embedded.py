"""
The embedded corpus: a small English-like corpus generated on the fly, so
training works offline with nothing to download.

Every document is drawn from a hand-written probabilistic grammar over a
vocabulary of about 500 English words (listed below). There are four kinds
of document:

- stories (about half): a named character of a fixed kind (a fox, a robot, ...),
  with a pronoun that matches the name, a home and a treasured coloured object,
  goes on a few episodes: meets a named friend, loses the object and finds it
  again, counts things, eats, talks. Names, pronouns, the object's colour and
  the home are introduced once and referred back to later in the document,
  so predicting them needs memory across hundreds of characters.
- notes (a fifth): facts such as "The code of the red box is 417." or "Ada keeps the
  lamp in the blue jar.", then the same facts asked back in a shuffled order
  ("What is the code of the red box? It is 417."): associative recall over a distance.
- lists (a fifth): a list of things is stated, then repeated, counted and queried
  (first item, last item, number of items): copying and counting.
- arithmetic (a tenth): sums, differences and products in words and digits,
  comparisons, counting up and down, and word problems with named people
  ("Mia has three apples. Leo gives her four more. How many apples does Mia have now? Seven.").

Output is a pure function of (seed, document index): each document uses its own
random.Random, drawing only from random(), so a given seed gives the same text on
every run and machine, and documents(n) is a prefix of documents(m) for n < m.

The default 6000 documents (200-1300 characters, ASCII) hold about 4.0 MB of text
(3.98M byte-level tokens with the end-of-text separators) and generate in well under
a second. Byte-level unigram entropy is about 3.17 nats, like English prose with
capitals, digits and punctuation; the previous byte alone brings it down to about
2.3 nats, and much of each document repeats what it said earlier, so a small model
can go far below that.

    from data.embedded import documents
    for text in documents(num_docs=10, seed=0): ...
"""

import random
from typing import Iterator

DEFAULT_NUM_DOCS = 6000

# ----------------------------------------------------------------------------
# vocabulary

HE_NAMES = ["Tom", "Ben", "Sam", "Max", "Leo", "Jack", "Finn", "Otto", "Hugo", "Milo",
            "Theo", "Oscar", "Felix", "Arlo", "Jasper", "Rufus", "Eli", "Noah"]
SHE_NAMES = ["Mia", "Lily", "Ada", "Nora", "Ella", "Ruby", "Zoe", "Ivy", "Luna", "Rosa",
             "Clara", "Greta", "Hazel", "Iris", "Maya", "Pia", "Wren", "June"]
NAMES = [(n, "he") for n in HE_NAMES] + [(n, "she") for n in SHE_NAMES]
PRONOUNS = {
    "he": {"subj": "he", "obj": "him", "pos": "his"},
    "she": {"subj": "she", "obj": "her", "pos": "her"},
}

KINDS = ["fox", "rabbit", "bear", "cat", "dog", "mouse", "owl", "duck", "frog", "goat",
         "pig", "horse", "robot", "dragon", "turtle", "squirrel", "hedgehog", "badger",
         "penguin", "lion", "tiger", "sheep", "wolf", "deer"]
PLURALS = {"fox": "foxes", "mouse": "mice", "sheep": "sheep", "deer": "deer", "wolf": "wolves",
           "box": "boxes", "peach": "peaches", "glass": "glasses", "bus": "buses",
           "cherry": "cherries", "strawberry": "strawberries", "butterfly": "butterflies",
           "leaf": "leaves", "berry": "berries", "penny": "pennies", "daisy": "daisies"}
TRAITS = ["little", "brave", "kind", "clever", "shy", "happy", "curious", "sleepy", "tiny",
          "gentle", "funny", "quiet", "busy", "friendly", "proud", "careful", "silly", "young", "old", "small"]
COLORS = ["red", "blue", "green", "yellow", "orange", "purple", "pink", "white", "black",
          "brown", "gray", "golden", "silver"]
THINGS = ["ball", "hat", "kite", "book", "cup", "drum", "lamp", "key", "shell", "stone",
          "scarf", "boat", "bell", "ring", "spoon", "map", "flute", "sock", "coat", "box",
          "feather", "button", "whistle", "basket", "umbrella", "clock", "candle", "brush"]
CONTAINERS = ["box", "jar", "bag", "chest", "basket", "drawer", "bottle", "tin", "cup", "pot", "bucket", "sack"]
HOMES = ["a small house by the river", "a hole under an old tree", "a tall house on the hill",
         "a little cave in the rocks", "a blue boat on the lake", "a warm nest in the barn",
         "a round house in the village", "a cabin in the woods", "a tower by the sea",
         "a cottage near the farm"]
PLACES = ["park", "forest", "garden", "beach", "market", "river", "lake", "hill", "farm",
          "village", "meadow", "bridge", "school", "library", "bakery", "pond", "field",
          "valley", "harbor", "orchard", "castle", "station", "playground", "zoo"]
HIDING_SPOTS = ["a rock", "a bush", "a pile of leaves", "the bridge", "a log", "a bench",
                "a big flower", "the table", "a bucket", "the stairs", "a blanket", "a cart"]
TIMES = ["morning", "afternoon", "evening", "day", "night"]
WEATHER = ["the sun was shining", "it was raining", "the wind was blowing", "it was snowing",
           "the sky was gray", "it was warm and bright", "it was cold and foggy", "the clouds were low"]
EMOTIONS = ["happy", "sad", "tired", "excited", "scared", "surprised", "proud", "hungry",
            "calm", "worried", "glad", "lonely", "cheerful", "sleepy"]
FOODS = ["apples", "bread", "cheese", "soup", "cake", "honey", "carrots", "berries",
         "pears", "nuts", "rice", "cookies", "plums", "pie", "eggs", "milk", "grapes", "beans"]
COUNTABLE = ["apple", "pear", "egg", "cookie", "plum", "carrot", "cherry", "peach", "stone",
             "shell", "flower", "coin", "book", "cup", "leaf", "berry", "box", "button", "penny", "daisy"]
ACTIVITIES = ["play", "sing", "dance", "read", "swim", "paint", "draw", "fly a kite", "build a fort",
              "play catch", "look for shells", "pick berries", "bake a cake", "go fishing", "tell stories"]
REACTIONS = ["smiled", "sat down", "looked at the sky", "sang a little song", "took a deep breath"]
GREETINGS = ["Hello", "Hi", "Good morning", "Hey", "Good day"]
MOVES = ["walked", "ran", "hopped", "went", "skipped", "raced", "wandered", "strolled", "hurried"]
SOUNDS = ["a song", "a bell", "a loud noise", "a soft voice", "a bird", "the wind", "a drum", "a splash"]
TREES = ["oak", "pine", "apple tree", "willow", "birch", "maple"]
SHOP_ITEMS = ["eggs", "milk", "bread", "butter", "apples", "rice", "tea", "jam", "soap", "salt",
              "honey", "cheese", "beans", "flour", "sugar", "lemons", "onions", "socks", "paper", "glue"]
ANIMAL_FACTS = [("likes", "What does the {kind} like?"), ("eats", "What does the {kind} eat?"),
                ("is afraid of", "What is the {kind} afraid of?"),
                ("dreams about", "What does the {kind} dream about?"),
                ("sings about", "What does the {kind} sing about?")]
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
                "ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen",
                "eighteen", "nineteen"]
TENS_WORDS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]


# ----------------------------------------------------------------------------
# randomness from random() only: its stream is stable across Python versions,
# unlike choice()/randint()/shuffle() whose algorithms may change

def pick(rng, seq):
    return seq[int(rng.random() * len(seq))]


def randint(rng, lo, hi):
    """Uniform integer in [lo, hi]."""
    return lo + int(rng.random() * (hi - lo + 1))


def shuffled(rng, seq):
    out = list(seq)
    for i in range(len(out) - 1, 0, -1):
        j = int(rng.random() * (i + 1))
        out[i], out[j] = out[j], out[i]
    return out


def sample(rng, seq, k):
    return shuffled(rng, seq)[:k]


def plural(word):
    return PLURALS.get(word, word + "s")


def spell(n):
    """0..99 in words: 42 -> forty-two."""
    if n < 20:
        return NUMBER_WORDS[n]
    tens, ones = divmod(n, 10)
    return TENS_WORDS[tens] + ("-" + NUMBER_WORDS[ones] if ones else "")


def count_phrase(n, word):
    return f"{spell(n)} {word if n == 1 else plural(word)}"


def a_or_an(word):
    return ("an " if word[0] in "aeiou" else "a ") + word


def join_list(items):
    if len(items) == 1:
        return items[0]
    return ", ".join(items[:-1]) + " and " + items[-1]


def cap(s):
    return s[0].upper() + s[1:]


class Character:
    def __init__(self, rng, taken=()):
        name, gender = pick(rng, [n for n in NAMES if n[0] not in taken])
        self.name = name
        self.kind = pick(rng, KINDS)
        self.trait = pick(rng, TRAITS)
        p = PRONOUNS[gender]
        self.he, self.him, self.his = p["subj"], p["obj"], p["pos"]


# ----------------------------------------------------------------------------
# stories: entities are fixed at the start and referred back to throughout


def story(rng):
    hero = Character(rng)
    friend = Character(rng, taken={hero.name})
    home = pick(rng, HOMES)
    treasure = f"{pick(rng, COLORS)} {pick(rng, THINGS)}"
    s = []
    s.append(pick(rng, [
        f"Once upon a time there was {a_or_an(hero.trait)} {hero.kind} named {hero.name}. "
        f"{cap(hero.he)} lived in {home}.",
        f"{hero.name} was {a_or_an(hero.trait)} {hero.kind} who lived in {home}.",
        f"In {home} lived {a_or_an(hero.trait)} {hero.kind}. {cap(hero.his)} name was {hero.name}.",
    ]))
    s.append(pick(rng, [
        f"{hero.name} had {a_or_an(treasure)} that {hero.he} loved more than anything.",
        f"{cap(hero.his)} favorite thing was {a_or_an(treasure)}.",
        f"Every day {hero.name} carried {a_or_an(treasure)} with {hero.him}.",
    ]))
    state = {"met": False, "lost": False}
    # episodes are drawn without replacement so a story does not repeat itself
    for episode in sample(rng, EPISODES, randint(rng, 3, 9)):
        s.extend(episode(rng, hero, friend, treasure, state))
    if state["lost"]:
        s.extend(find_treasure(rng, hero, friend, treasure, state))
    s.append(pick(rng, [
        f"When the sun went down, {hero.name} went back to {home}. "
        f"{cap(hero.he)} put the {treasure} by {hero.his} bed and fell asleep.",
        f"At the end of the day, {hero.name} the {hero.kind} walked home to {home} with the {treasure}.",
        f"That night {hero.name} held the {treasure} and thought about the day. "
        f"{cap(hero.he)} was {pick(rng, EMOTIONS)}.",
    ]))
    s.append(pick(rng, ["The end.", "The end.", f"And that is the story of {hero.name} the {hero.kind}."]))
    return " ".join(s)


def here(rng, state):
    """The place the story is at, so later sentences stay there."""
    if "place" not in state:
        state["place"] = pick(rng, PLACES)
    return state["place"]


def go_somewhere(rng, hero, friend, treasure, state):
    place = pick(rng, PLACES)
    state["place"] = place
    out = [f"One {pick(rng, TIMES)}, {hero.name} {pick(rng, MOVES)} to the {place}."]
    if rng.random() < 0.5:
        out.append(f"{cap(pick(rng, WEATHER))}.")
    return out


def meet_friend(rng, hero, friend, treasure, state):
    place = here(rng, state)
    if not state["met"]:
        state["met"] = True
        return [f"At the {place}, {hero.he} met {a_or_an(friend.trait)} {friend.kind} named {friend.name}.",
                f'"{pick(rng, GREETINGS)}, {friend.name}!" said {hero.name}. "I am {hero.name}."']
    return [f"{hero.name} saw {friend.name} the {friend.kind} again near the {place}.",
            f'"{pick(rng, GREETINGS)}, {hero.name}," said {friend.name}.']


def play(rng, hero, friend, treasure, state):
    activity = pick(rng, ACTIVITIES)
    if not state["met"]:
        return [f"{hero.name} wanted to {activity}, but {hero.he} had no one to {activity} with.",
                f"{cap(hero.he)} felt {pick(rng, ['lonely', 'sad', 'bored', 'quiet'])}."]
    return [f'"Do you want to {activity} with me?" asked {hero.name}.',
            f'"Yes!" said {friend.name}. "I love to {activity}."',
            f"So {hero.name} and {friend.name} went to {activity} together."]


def lose_treasure(rng, hero, friend, treasure, state):
    if state["lost"]:
        return [f"{hero.name} looked everywhere for the {treasure}, but {hero.he} could not find it."]
    state["lost"] = True
    place = here(rng, state)
    return [f"Oh no! {hero.name} lost the {treasure} near the {place}.",
            f"{cap(hero.he)} was very {pick(rng, ['sad', 'worried', 'upset', 'scared'])}."]


def find_treasure(rng, hero, friend, treasure, state):
    state["lost"] = False
    finder = friend if state["met"] else hero
    return [f"{finder.name} looked under {pick(rng, HIDING_SPOTS)} and found the {treasure}!",
            f"{hero.name} was so {pick(rng, ['happy', 'glad', 'relieved', 'pleased'])} to have the {treasure} back."]


def eat(rng, hero, friend, treasure, state):
    food, food2 = sample(rng, FOODS, 2)
    who = f"{hero.name} and {friend.name}" if state["met"] else hero.name
    return [f"{who} ate {food} and {food2} under {a_or_an(pick(rng, TREES))}.",
            f"The {food} were {pick(rng, ['sweet', 'good', 'fresh', 'warm', 'soft'])}." if food.endswith("s")
            else f"The {food} was {pick(rng, ['sweet', 'good', 'fresh', 'warm', 'soft'])}."]


def count_things(rng, hero, friend, treasure, state):
    thing = pick(rng, COUNTABLE + KINDS)
    a, b = randint(rng, 1, 9), randint(rng, 1, 9)
    place = here(rng, state)
    return [f"{hero.name} saw {count_phrase(a, thing)} at the {place}.",
            f"Then {spell(b)} more came, so there were {count_phrase(a + b, thing)}."]


def hear_sound(rng, hero, friend, treasure, state):
    return [f"Suddenly {hero.name} heard {pick(rng, SOUNDS)}.",
            f'"What was that?" said {hero.name}, and {hero.he} held the {treasure} tight.']


def feel(rng, hero, friend, treasure, state):
    emotion = pick(rng, EMOTIONS)
    return [f"{hero.name} the {hero.kind} felt {emotion}.",
            f"{cap(hero.he)} {pick(rng, REACTIONS)}."]


def help_friend(rng, hero, friend, treasure, state):
    if not state["met"]:
        return go_somewhere(rng, hero, friend, treasure, state)
    need = pick(rng, THINGS)
    return [f"{friend.name} needed {a_or_an(need)}.",
            f"{hero.name} gave {friend.name} {hero.his} old {need}, "
            f"and {friend.name} said, \"Thank you, {hero.name}!\""]


EPISODES = [go_somewhere, go_somewhere, meet_friend, meet_friend, play, lose_treasure,
            eat, count_things, hear_sound, feel, help_friend]


# ----------------------------------------------------------------------------
# notes: facts stated, then asked back in another order (associative recall)


def notes(rng):
    owner, _ = pick(rng, NAMES)
    facts = []  # (statement, question with its answer)
    boxes = sample(rng, [(c, k) for c in COLORS for k in CONTAINERS], randint(rng, 3, 8))
    keepers = sample(rng, [(n, t) for n, _ in NAMES for t in THINGS], len(boxes))
    for (color, container), (keeper, thing) in zip(boxes, keepers):
        if rng.random() < 0.6:
            code = randint(rng, 10, 999)
            facts.append((f"The code of the {color} {container} is {code}.",
                          f"What is the code of the {color} {container}? It is {code}."))
        else:
            facts.append((f"{keeper} keeps the {thing} in the {color} {container}.",
                          f"Where does {keeper} keep the {thing}? In the {color} {container}."))
    animal_facts = sample(rng, [(k, f) for k in KINDS for f in ANIMAL_FACTS], randint(rng, 0, 3))
    for kind, (verb, question) in animal_facts:
        food = pick(rng, FOODS)
        facts.append((f"The {kind} {verb} {food}.", f"{question.format(kind=kind)} {cap(food)}."))
    facts = shuffled(rng, facts)
    lines = [pick(rng, [f"These are the notes of {owner}.", f"{owner} wrote this down.",
                        "Notes:", "Remember these facts."])]
    lines += [statement for statement, _ in facts]
    lines.append(pick(rng, ["Questions:", "Now answer.", "Let us check.", "Quiz:"]))
    lines += [question for _, question in shuffled(rng, facts)]
    return "\n".join(lines)


# ----------------------------------------------------------------------------
# lists: copy, count and index


def lists(rng):
    name, gender = pick(rng, NAMES)
    he = PRONOUNS[gender]["subj"]
    lines = []
    for _ in range(randint(rng, 1, 4)):
        items = sample(rng, SHOP_ITEMS, randint(rng, 2, 7))
        n = len(items)
        lines.append(f"{name} made a list of things to buy: {join_list(items)}.")
        lines.append(pick(rng, [f"Again: {', '.join(items)}.", f"The list is {', '.join(items)}."]))
        lines.append(f"The list has {NUMBER_WORDS[n]} things. "
                     f"The first thing is {items[0]}. The last thing is {items[-1]}.")
        if n > 2 and rng.random() < 0.5:
            lines.append(f"The second thing is {items[1]}.")
        bought = randint(rng, 1, n)
        left = n - bought
        lines.append(f"{cap(he)} bought {NUMBER_WORDS[bought]} of them, "
                     f"so {NUMBER_WORDS[left]} {'is' if left == 1 else 'are'} left.")
    return "\n".join(lines)


# ----------------------------------------------------------------------------
# arithmetic and counting


def arithmetic(rng):
    lines = [pick(rng, ["Math practice.", "Numbers.", "Let us count.", "Sums:"])]
    for _ in range(randint(rng, 6, 20)):
        lines.append(pick(rng, ARITHMETIC_LINES)(rng))
    return "\n".join(lines)


def plus(rng):
    a, b = randint(rng, 0, 20), randint(rng, 0, 20)
    return pick(rng, [f"{spell(a)} plus {spell(b)} is {spell(a + b)}.", f"{a} + {b} = {a + b}"])


def minus(rng):
    a, b = randint(rng, 0, 20), randint(rng, 0, 20)
    a, b = max(a, b), min(a, b)
    return pick(rng, [f"{spell(a)} minus {spell(b)} is {spell(a - b)}.", f"{a} - {b} = {a - b}"])


def times(rng):
    a, b = randint(rng, 1, 9), randint(rng, 1, 9)
    return pick(rng, [f"{spell(a)} times {spell(b)} is {spell(a * b)}.", f"{a} x {b} = {a * b}"])


def count_up(rng):
    start = randint(rng, 0, 40)
    step = pick(rng, [1, 1, 1, 2, 5, 10])
    n = randint(rng, 4, 10)
    seq = [str(start + i * step) for i in range(n)]
    by = "" if step == 1 else f" by {step}s"
    return f"Count{by} from {seq[0]} to {seq[-1]}: {', '.join(seq)}."


def count_down(rng):
    start = randint(rng, 5, 20)
    return f"Count down from {start}: {', '.join(str(i) for i in range(start, -1, -1))}."


def compare(rng):
    a, b = sample(rng, range(100), 2)
    return pick(rng, [f"Which is bigger, {a} or {b}? {max(a, b)}.", f"Which is smaller, {a} or {b}? {min(a, b)}."])


def next_number(rng):
    n = randint(rng, 1, 99)
    return pick(rng, [f"What comes after {n}? {n + 1}.", f"What comes before {n}? {n - 1}.",
                      f"{n} is {'even' if n % 2 == 0 else 'odd'}."])


def word_problem(rng):
    name, gender = pick(rng, NAMES)
    p = PRONOUNS[gender]
    friend, _ = pick(rng, [n for n in NAMES if n[0] != name])
    thing = pick(rng, COUNTABLE)
    a, b = randint(rng, 1, 12), randint(rng, 1, 12)
    if rng.random() < 0.5:
        return (f"{name} has {count_phrase(a, thing)}. {friend} gives {p['obj']} {spell(b)} more. "
                f"How many {plural(thing)} does {name} have now? {cap(spell(a + b))}.")
    a, b = max(a, b), min(a, b)
    return (f"{name} has {count_phrase(a, thing)}. {cap(p['subj'])} gives {spell(b)} to {friend}. "
            f"How many {plural(thing)} does {name} have left? {cap(spell(a - b))}.")


ARITHMETIC_LINES = [plus, plus, minus, minus, times, count_up, count_down, compare, next_number,
                    word_problem, word_problem]


# ----------------------------------------------------------------------------

DOCUMENT_KINDS = [story] * 5 + [notes] * 2 + [lists] * 2 + [arithmetic]


def document(seed: int, index: int) -> str:
    rng = random.Random(seed * 2**32 + index)
    text = pick(rng, DOCUMENT_KINDS)(rng)
    # a few kinds can come out very short: append another document rather than keep tiny ones
    while len(text) < 200:
        text += "\n\n" + pick(rng, DOCUMENT_KINDS)(rng)
    return text


def documents(num_docs: int = DEFAULT_NUM_DOCS, seed: int = 0) -> Iterator[str]:
    """Yield num_docs documents of the embedded corpus; the same seed gives the same text."""
    for index in range(num_docs):
        yield document(seed, index)


if __name__ == "__main__":
    for text in documents(num_docs=4):
        print(text, end="\n\n----\n\n")
