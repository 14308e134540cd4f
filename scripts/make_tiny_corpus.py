"""Generate litgpt's bundled tiny corpus and train its tokenizer.

    python scripts/make_tiny_corpus.py [--out_dir litgpt/data/tiny] [--seed 42]

It lives in the repository's scripts/, not in the installed package: run it from a checkout of litgpt.

The corpus is written by this program, not collected: short, simple English children's stories (named characters
with consistent pronouns, places, objects, feelings, dialogue in quotes, a beginning, a problem and an ending, with
some cause and effect), assembled from the word lists and sentence templates below by `random.Random(seed)`. The
same seed gives the same text, byte for byte, on every machine and Python version >= 3.10: only `Random.choice`,
`Random.sample` and `Random.random` are called, always on tuples, and nothing depends on set or dict ordering. The
tokenizer training is deterministic too (same files on every run, whatever the number of threads or the hash seed);
another version of the `tokenizers` library may lay out tokenizer.json differently, with the same vocabulary.

Written to `out_dir`:

- `train.txt` (about 2.5 MB) and `val.txt` (about 150 KB): ASCII stories, one blank line between two stories and none
  inside one; no story is in both files. To train, split on blank lines and wrap each story as `<s> story </s>`.
- `tokenizer/`: a byte-level BPE tokenizer trained on `train.txt` with the `tokenizers` library, 4096 entries in all
  (`<s>` = 0 is BOS and is added in front of every encoded text by the post-processor, `</s>` = 1 is EOS), saved as a
  Hugging Face tokenizer folder: `tokenizer.json`, `tokenizer_config.json`, `generation_config.json`.
- `README.md`: what the files are and the numbers of this build.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

# The bundled corpus in the checkout this script belongs to.
DEFAULT_OUT_DIR = Path(__file__).resolve().parents[1] / "litgpt" / "data" / "tiny"
DEFAULT_SEED = 42
TRAIN_CHARS = 2_500_000
VAL_CHARS = 150_000
VOCAB_SIZE = 4096
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
MODEL_MAX_LENGTH = 2048
STORY_SEPARATOR = "\n\n"

# ---- word lists ---------------------------------------------------------------------------------------------------
GIRL_NAMES = (
    "Lily", "Mia", "Emma", "Sara", "Anna", "Lucy", "Ella", "Ruby", "Zoe", "Chloe", "Grace", "Hannah", "Amy", "Ava",
    "Sophie", "Molly", "Rosie", "Daisy", "Maya", "Nora", "Ivy", "Alice", "Clara", "Julia", "Kate", "Lola", "Nina",
    "Olivia", "Poppy", "Rose", "Stella", "Tina", "Vera", "Wendy", "Bella", "Jenny", "Susie", "Holly", "Fiona",
    "Layla", "Leah", "Luna", "Mila", "Elsa", "Ellie", "Eva", "Jane", "June", "Kim", "Lisa", "Mary", "Nell",
    "Penny", "Rita", "Tess", "Violet", "Willow", "Hazel", "Iris", "Jade", "Amber", "Megan", "Abby", "Beth",
    "Carla", "Dora", "Emily", "Freya", "Gemma", "Heidi", "Isla", "Jess", "Kira", "Lena", "Maggie", "Nadia",
    "Paula", "Quinn", "Rachel", "Sally", "Tara", "Ursula", "Wanda", "Yara", "Zara", "Aisha", "Priya", "Mei",
    "Sofia", "Lucia", "Ines", "Hana", "Amara", "Keiko", "Fatima", "Elena", "Greta", "Ingrid", "Olga", "Rosa",
    "Ada", "Bianca", "Cora", "Delia", "Edith", "Flora", "Gloria", "Harriet", "Imogen", "Josie", "Kayla", "Lottie",
    "Mabel", "Naomi", "Odette", "Pia", "Rhea", "Selma", "Thea", "Uma", "Valerie", "Winnie", "Yasmin", "Zelda",
    "Agnes", "Beatrice", "Celia", "Daphne", "Esme", "Frida", "Georgia", "Harper", "Juno", "Louisa", "Marta", "Nia",
    "Opal", "Petra", "Roxy", "Sienna", "Tilly", "Vivian", "Wren", "Ximena", "Yuki", "Zuri", "Aria", "Bonnie",
    "Cleo", "Dina", "Eliza", "Fay", "Gina", "Hope", "Isabel", "Joy",
)
BOY_NAMES = (
    "Tom", "Max", "Ben", "Sam", "Leo", "Jack", "Tim", "Finn", "Noah", "Liam", "Oliver", "Jake", "Lucas", "Ethan",
    "Henry", "Charlie", "Oscar", "Theo", "Milo", "Toby", "Adam", "Alex", "Billy", "Bobby", "Carl", "Danny",
    "David", "Eddie", "Felix", "Frank", "George", "Harry", "Ian", "Joe", "Kevin", "Larry", "Mark", "Ned",
    "Owen", "Peter", "Ryan", "Simon", "Teddy", "Victor", "Will", "Zack", "Arthur", "Bruno", "Caleb", "Dylan",
    "Eli", "Gabe", "Hugo", "Isaac", "Jonah", "Kai", "Luke", "Mason", "Nathan", "Omar", "Paul", "Reed", "Rory",
    "Seth", "Tyler", "Vince", "Wyatt", "Yusuf", "Aaron", "Boris", "Colin", "Derek", "Evan", "Gavin", "Jasper",
    "Kofi", "Logan", "Marco", "Nico", "Otto", "Pedro", "Rafael", "Ravi", "Sven", "Tariq", "Umar", "Kenji", "Hiro",
    "Diego", "Mateo", "Ivan", "Anton", "Emil", "Jonas", "Louis", "Mario", "Neil", "Rowan",
    "Abel", "Basil", "Cyrus", "Dominic", "Elliot", "Fabian", "Gus", "Harvey", "Ibrahim", "Jude", "Kurt", "Lenny",
    "Miles", "Nolan", "Ollie", "Percy", "Quentin", "Ralph", "Stanley", "Tobias", "Walter", "Xavier", "Yosef",
    "Zeke", "Alfie", "Benji", "Chester", "Damian", "Ezra", "Freddie", "Gideon", "Hector", "Jamal", "Kian", "Lars",
    "Malik", "Nate", "Orlando", "Pablo", "Rocco", "Samir", "Timo", "Vikram", "Wesley", "Yann", "Zane", "Archie",
    "Bert", "Cody", "Dante", "Enzo", "Flynn", "Grant", "Hank",
)
PET_NAMES = (
    "Pip", "Buddy", "Coco", "Bella", "Spot", "Fluffy", "Rex", "Bingo", "Patch", "Sunny", "Pepper", "Biscuit",
    "Muffin", "Ziggy", "Shadow", "Snowy", "Button", "Peanut", "Waffles", "Rusty", "Ginger", "Tiger", "Bubbles",
    "Daisy", "Honey", "Nibbles", "Pickles", "Socks", "Oreo", "Mittens", "Bounce", "Puff", "Sparky", "Noodle",
    "Pebble", "Twig", "Hopper", "Whiskers", "Fuzzy", "Clover", "Maple", "Acorn", "Berry", "Cookie", "Dot", "Fern",
    "Gizmo", "Jelly", "Kiwi", "Lucky", "Marble", "Nutmeg", "Olive", "Pudding", "Rolo", "Scout", "Toffee", "Velvet",
    "Bramble", "Cinnamon", "Dumpling", "Fidget", "Gumdrop", "Hazelnut", "Jingles", "Ketchup", "Lollipop", "Mochi",
    "Nugget", "Popcorn", "Quill", "Rascal", "Sprout", "Tumble", "Wiggles", "Zippy", "Barnaby", "Crumpet", "Doodle",
    "Flapjack", "Marshmallow", "Pretzel", "Sage", "Thistle", "Truffle", "Pumpkin",
)
CHILD_ADJS = (
    "little", "young", "happy", "curious", "kind", "cheerful", "clever", "friendly", "gentle", "playful", "sweet",
    "busy", "quiet", "lively", "shy", "brave", "funny", "thoughtful",
)
ANIMAL_KINDS = (
    "bunny", "fox", "bear", "duck", "mouse", "frog", "owl", "pig", "lamb", "squirrel", "hedgehog", "kitten",
    "puppy", "turtle", "deer", "raccoon", "otter", "panda", "penguin", "goat", "chick", "monkey", "elephant",
    "lion", "tiger", "koala", "beaver", "badger", "mole", "robin", "sparrow", "seal", "pony", "zebra", "giraffe",
    "hamster", "kangaroo", "rhino", "hippo", "camel", "cheetah", "wolf", "moose", "swan", "crab", "snail",
    "dolphin", "whale", "octopus", "flamingo", "peacock", "hen", "donkey", "lizard", "parrot", "skunk", "chipmunk",
    "porcupine", "walrus", "polar bear", "gorilla", "beetle", "ladybug",
)
ANIMAL_ADJS = (
    "little", "small", "happy", "curious", "kind", "fluffy", "clever", "friendly", "gentle", "playful", "tiny",
    "busy", "quiet", "brave", "sleepy", "young", "funny", "cheerful",
)
PET_KINDS = ("dog", "cat", "puppy", "kitten")
CHILD_HOMES = (
    "a small house near the woods", "a little town by the sea", "a big city", "a quiet village",
    "a yellow house on a hill", "a cozy house with a red door", "a farmhouse with many animals around it",
    "a blue house next to a park", "a busy town full of shops", "a white house with a big garden",
    "a small cottage by a river", "a tall building with many windows", "a green house at the end of a lane",
    "a little apartment above a bakery", "a house with a round window", "a cabin in the mountains",
)
ANIMAL_HOMES = (
    "a big green forest", "a sunny meadow", "a quiet forest near a river", "a cozy hole under an old oak tree",
    "a little den on a hill", "a warm nest in a tall tree", "a red barn on a farm", "a pond full of lily pads",
    "a field of tall grass", "a jungle full of trees", "a snowy valley", "a garden behind a little house",
    "a cave by the ocean", "a rocky cove", "a zoo in the middle of town", "a wide desert with tall cactus plants",
)
TRAITS = (
    "kind", "curious", "brave", "shy", "funny", "helpful", "cheerful", "clever", "gentle", "busy", "playful", "polite",
)
# (base form, past tense) of things to do.
ACTIVITIES = (
    ("play tag", "played tag"), ("swing on the swings", "swung on the swings"),
    ("build sandcastles", "built sandcastles"), ("kick a ball around", "kicked a ball around"),
    ("fly a kite", "flew a kite"), ("look for bugs under the rocks", "looked for bugs under the rocks"),
    ("draw pictures with chalk", "drew pictures with chalk"), ("play hide and seek", "played hide and seek"),
    ("race to the big tree", "raced to the big tree"), ("jump over the puddles", "jumped over the puddles"),
    ("roll down the grassy hill", "rolled down the grassy hill"), ("blow bubbles", "blew bubbles"),
    ("play catch", "played catch"), ("slide down the big slide", "slid down the big slide"),
    ("look at the clouds", "looked at the clouds"), ("dig in the sand", "dug in the sand"),
    ("chase butterflies", "chased butterflies"), ("pick flowers", "picked flowers"),
    ("sing songs", "sang songs"), ("dance in the sun", "danced in the sun"), ("read books", "read books"),
    ("climb trees", "climbed trees"), ("collect shiny rocks", "collected shiny rocks"),
    ("paint with bright colors", "painted with bright colors"), ("watch the birds", "watched the birds"),
    ("splash in the pond", "splashed in the pond"), ("build towers with blocks", "built towers with blocks"),
    ("play with toy cars", "played with toy cars"), ("make paper boats", "made paper boats"),
    ("count the stars", "counted the stars"), ("play pretend", "played pretend"),
    ("jump rope", "jumped rope"), ("ride a little bike", "rode a little bike"),
)
COLORS = (
    "red", "blue", "green", "yellow", "pink", "purple", "orange", "white", "brown", "golden", "silver", "striped",
    "spotted", "shiny", "soft", "old", "new", "bright",
)
# (noun, soft) of things a child can own, lose, share or break.
OBJECTS = (
    ("ball", False), ("teddy bear", True), ("toy car", False), ("kite", False), ("doll", True),
    ("toy train", False), ("hat", True), ("scarf", True), ("toy boat", False), ("storybook", False),
    ("robot", False), ("drum", False), ("whistle", False), ("yo-yo", False), ("bucket", False), ("crown", False),
    ("necklace", False), ("blanket", True), ("pillow", True), ("balloon", True), ("truck", False),
    ("toy airplane", False), ("spinning top", False), ("backpack", True), ("umbrella", False), ("mitten", True),
    ("music box", False), ("toy dinosaur", False), ("stuffed bunny", True), ("rubber duck", False),
    ("flashlight", False), ("paintbrush", False), ("bracelet", False), ("wagon", False), ("puppet", True),
    ("toy horse", False), ("kaleidoscope", False), ("jump rope", True), ("sock monkey", True), ("lunchbox", False),
    ("sticker book", False), ("toy drum", False), ("marble", False), ("seashell", False), ("pinwheel", False),
    ("treasure box", False), ("toy rocket", False), ("magic wand", False), ("tiara", False), ("sled", False),
    ("scooter", False), ("skateboard", False), ("toy tractor", False), ("fairy costume", True),
    ("superhero cape", True), ("piggy bank", False), ("glitter pen", False), ("tea set", False),
    ("toy piano", False), ("jigsaw puzzle", False), ("tennis ball", False), ("baseball cap", True),
    ("snow globe", False), ("butterfly net", False), ("telescope", False), ("harmonica", False), ("compass", False),
)
HIDING_SPOTS = (
    "under the bed", "behind the couch", "in the toy box", "under the table", "next to the front door",
    "in the garden", "behind the big tree", "under a pile of leaves", "in the kitchen", "on the top shelf",
    "inside an old boot", "in the laundry basket", "under the stairs", "near the pond", "in the sandbox",
    "under the blanket", "behind the curtains", "in the car", "beside the flower pot", "in the bathtub",
    "under the slide", "behind the shed", "in the closet", "under the pillows", "inside the wagon",
)
PLAY_PLACES = (
    "the park", "the playground", "the beach", "the meadow", "the garden", "the big field", "the pond",
    "the library", "the school yard", "the town square", "the orchard", "the forest path", "the sandbox",
    "the swimming pool", "the community garden", "the skate park", "the picnic area",
)
FRIEND_SPOTS = (
    "on a bench", "under a tree", "by the swings", "near the fence", "on a big rock", "by the water",
    "behind a bush", "on the steps", "next to the slide", "in the corner",
)
RELATIVES = (
    # (name in the story, female)
    ("Mom", True), ("Dad", False), ("Grandma", True), ("Grandpa", False),
)
TIME_OPENERS = (
    "One day,", "One sunny morning,", "One afternoon,", "Early one morning,", "One windy afternoon,",
    "On Saturday,", "One morning,", "One evening,", "Last week,", "One bright day,", "After breakfast one day,",
    "One cloudy morning,",
)
SAD_WORDS = ("sad", "lonely", "upset", "unhappy", "gloomy")
HAPPY_WORDS = ("happy", "glad", "cheerful", "joyful", "delighted")
HAPPY_ENDINGS = (
    "{name} felt happy all day long.",
    "{name} smiled all the way home.",
    "It was the best day {he} had ever had.",
    "That night, {name} fell asleep with a big smile.",
    "{name} felt warm and happy inside.",
    "{He} could not stop smiling.",
)
BEDTIME_MORALS = (
    "Being kind is the best way to make a new friend.",
    "A friend can make any day better.",
    "A little kindness can turn a sad day into a happy one.",
)


# ---- characters and sentences -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Char:
    """A character: what the story calls it and the pronouns that go with it."""

    name: str
    kind: str = ""
    female: bool = True
    adj: str = ""
    home: str = ""

    @property
    def he(self) -> str:
        return "she" if self.female else "he"

    @property
    def him(self) -> str:
        return "her" if self.female else "him"

    @property
    def his(self) -> str:
        return "her" if self.female else "his"

    @property
    def himself(self) -> str:
        return "herself" if self.female else "himself"

    @property
    def He(self) -> str:
        return cap(self.he)

    @property
    def His(self) -> str:
        return cap(self.his)

    @property
    def desc(self) -> str:
        """"little girl", "curious fox" (no article)."""
        return f"{self.adj} {self.kind}".strip()


def cap(text: str) -> str:
    return text[:1].upper() + text[1:]


def a(phrase: str) -> str:
    """The phrase with "a" or "an" in front."""
    vowel_sound = phrase[:1] in "aeiou" and not phrase.startswith(("uni", "use", "one", "eu"))
    return ("an " if vowel_sound else "a ") + phrase


class Story:
    """Sentences grouped in paragraphs; `say` puts dialogue in quotes with a speaker tag before or after."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.paragraphs: list[list[str]] = [[]]

    def add(self, *sentences: Optional[str]) -> None:
        self.paragraphs[-1].extend(s for s in sentences if s)

    def para(self) -> None:
        if self.paragraphs[-1]:
            self.paragraphs.append([])

    def say(self, speaker: str, words: str, verb: str = "said") -> None:
        """`"Words," Lily said.` or `"Words," said Lily.` or `Lily said, "Words."`."""
        self.add(self.quote(speaker, words, verb))

    def quote(self, speaker: str, words: str, verb: str = "said") -> str:
        # "said Lily" reads well, "said she" and "said softly Lily" do not.
        invertible = speaker not in ("he", "she", "they") and " " not in verb
        form = self.rng.choice((0, 0, 1, 2) if invertible else (0, 0, 2))
        if form == 2:
            return f'{cap(speaker)} {verb}, "{words}"'
        spoken = words[:-1] + "," if words.endswith(".") else words
        if form == 1:
            return f'"{spoken}" {verb} {speaker}.'
        return f'"{spoken}" {speaker} {verb}.'

    def text(self) -> str:
        return "\n".join(" ".join(p) for p in self.paragraphs if p)


class Writer:
    """Makes up characters and the sentences most stories share."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def pick(self, options: Sequence):
        return self.rng.choice(tuple(options))

    def chance(self, p: float) -> bool:
        return self.rng.random() < p

    def child(self, avoid: Sequence[str] = ()) -> Char:
        female = self.chance(0.5)
        names = tuple(n for n in (GIRL_NAMES if female else BOY_NAMES) if n not in avoid)
        return Char(
            name=self.pick(names),
            kind="girl" if female else "boy",
            female=female,
            adj=self.pick(CHILD_ADJS),
            home=self.pick(CHILD_HOMES),
        )

    def animal(self, avoid: Sequence[str] = (), kinds: Sequence[str] = ANIMAL_KINDS) -> Char:
        names = tuple(n for n in PET_NAMES if n not in avoid)
        return Char(
            name=self.pick(names),
            kind=self.pick(kinds),
            female=self.chance(0.5),
            adj=self.pick(ANIMAL_ADJS),
            home=self.pick(ANIMAL_HOMES),
        )

    def hero(self, avoid: Sequence[str] = ()) -> Char:
        return self.animal(avoid) if self.chance(0.3) else self.child(avoid)

    def friend_like(self, hero: Char) -> Char:
        """A second character of the hero's world: a child for a child, an animal for an animal."""
        avoid = (hero.name,)
        if hero.kind in ("girl", "boy"):
            return self.child(avoid)
        return self.animal(avoid)

    def pet(self, avoid: Sequence[str] = ()) -> Char:
        return self.animal(avoid, kinds=PET_KINDS)

    def relative(self) -> Char:
        name, female = self.pick(RELATIVES)
        return Char(name=name, kind=name.lower(), female=female)

    def thing(self) -> tuple[str, bool]:
        noun, soft = self.pick(OBJECTS)
        if self.chance(0.6):
            return f"{self.pick(COLORS)} {noun}", soft
        return noun, soft

    # ---- shared sentences --------------------------------------------------------------------------------------
    def opening(self, hero: Char) -> str:
        who = a(hero.desc)
        return self.pick(
            (
                f"Once upon a time, there was {who} named {hero.name}.",
                f"Once upon a time, in {hero.home}, there lived {who} named {hero.name}.",
                f"There was once {who} named {hero.name}.",
                f"{hero.name} was {who} who lived in {hero.home}.",
                f"Once there was {who} called {hero.name}.",
                f"In {hero.home}, there lived {who} named {hero.name}.",
            )
        )

    def trait(self, hero: Char) -> str:
        base, _ = self.pick(ACTIVITIES)
        trait = self.pick(tuple(t for t in TRAITS if t != hero.adj))
        return self.pick(
            (
                f"{hero.He} loved to {base}.",
                f"{hero.He} liked to {base} every day.",
                f"Every day, {hero.he} liked to {base}.",
                f"More than anything, {hero.name} loved to {base}.",
                f"{hero.He} was very {trait} and loved to {base}.",
                f"{hero.name} was {trait}, and {hero.his} favorite thing was to {base}.",
            )
        )

    def when(self) -> str:
        return self.pick(TIME_OPENERS)

    def happy_end(self, hero: Char) -> str:
        return self.pick(HAPPY_ENDINGS).format(name=hero.name, he=hero.he, He=hero.He)

    def hug(self, giver: Char, taker: Char) -> str:
        return self.pick(
            (
                f"{giver.name} gave {taker.name} a big hug.",
                f"{giver.name} hugged {taker.name} tight.",
                f"{giver.name} smiled and hugged {taker.name}.",
            )
        )


# ---- the plots ----------------------------------------------------------------------------------------------------
def lost_item(w: Writer, s: Story) -> None:
    hero = w.hero()
    thing, _ = w.thing()
    spots = w.rng.sample(HIDING_SPOTS, 3)
    helper_kind = w.pick(("relative", "friend", "pet") if hero.kind in ("girl", "boy") else ("relative", "friend"))
    helper = {"relative": w.relative, "friend": lambda: w.friend_like(hero), "pet": lambda: w.pet((hero.name,))}[
        helper_kind
    ]()

    s.add(w.opening(hero))
    s.add(
        w.pick(
            (
                f"{hero.He} had {a(thing)} that {hero.he} loved very much.",
                f"{hero.His} favorite toy was {a(thing)}.",
                f"{hero.name} had {a(thing)}, and it was {hero.his} favorite thing in the world.",
            )
        )
    )
    s.add(w.pick((f"{hero.He} took it everywhere {hero.he} went.", f"{hero.He} played with it every day.", None)))
    s.para()
    s.add(f"{w.when()} {hero.name} could not find {hero.his} {thing}.")
    s.add(f"{hero.He} looked {spots[0]}, but it was not there.")
    s.add(w.pick((f"{hero.He} looked {spots[1]}. It was not there either.",
                  f"Then {hero.he} looked {spots[1]}. Still no {thing}.")))
    s.add(w.pick((f"{hero.name} felt {w.pick(SAD_WORDS)}.",
                  f"{hero.name} sat down and started to cry.",
                  f"{hero.name} was very worried.")))
    s.para()
    if helper_kind == "pet":
        s.add(f"Just then, {hero.his} {helper.kind}, {helper.name}, came running into the room.")
        s.add(f"{helper.name} was holding something in {helper.his} mouth.")
        s.add(f"It was the {thing}!")
        s.add(f"{helper.name} had found it {spots[2]} and wanted to play with it.")
        s.say(hero.name, f"{helper.name}, you found it!", "shouted")
        s.para()
        s.add(f"{hero.name} laughed and patted {helper.name} on the head.")
        s.add(w.pick((f"{hero.He} gave {helper.name} a treat to say thank you.",
                      f"{helper.name} wagged {helper.his} tail.")))
    else:
        who = f"{hero.his} {helper.kind}" if helper_kind == "relative" else f"{hero.his} friend {helper.name}"
        s.add(f"{cap(who)} saw {hero.name} and came over.")
        s.say(helper.name, w.pick(("Why are you sad?", "What is wrong?", "Are you okay?")), "asked")
        s.say(hero.name, f"I lost my {thing}. I looked everywhere.")
        s.say(helper.name,
              w.pick(("Don't worry. I will help you look.", "Let's look together.", "Two can look better than one.")))
        s.para()
        s.add(f"They looked {spots[2]}.")
        s.say(helper.name, w.pick(("Look! There it is!", "I see it!", "Here it is!")), "shouted")
        cause = w.pick(
            (
                f"{hero.name} had left it there the day before, when {hero.he} was playing.",
                f"It had rolled there when {hero.name} was not looking.",
                f"{hero.name} had put it there and then forgot.",
            )
        )
        s.add(cause)
        s.para()
        s.add(f"{hero.name} hugged {hero.his} {thing}. {hero.He} was so {w.pick(HAPPY_WORDS)}.")
        s.say(hero.name, f"Thank you, {helper.name}!")
    s.add(
        w.pick(
            (
                f"From that day on, {hero.name} always put {hero.his} {thing} in a safe place.",
                f"After that, {hero.name} was careful to keep {hero.his} {thing} where {hero.he} could find it.",
                w.happy_end(hero),
            )
        )
    )


def new_friend(w: Writer, s: Story) -> None:
    hero = w.hero()
    other = w.friend_like(hero)
    rel = w.relative()
    place = w.pick(PLAY_PLACES)
    base, past = w.pick(ACTIVITIES)
    reason_thing, _ = w.thing()

    s.add(w.opening(hero))
    s.add(w.trait(hero))
    s.para()
    s.add(f"{w.when()} {hero.name} went to {place} with {hero.his} {rel.kind}.")
    s.add(f"There, {hero.he} saw {a(other.desc)} sitting all alone {w.pick(FRIEND_SPOTS)}.")
    s.add(f"The {other.kind} looked {w.pick(SAD_WORDS)}.")
    s.add(f'{hero.name} walked over and said, "Hi, I am {hero.name}. What is your name?"')
    s.say(f"the {other.kind}", f"My name is {other.name}.", w.pick(("said", "said softly", "answered")))
    s.say(hero.name, w.pick(("Why are you sad?", "Why are you sitting all alone?", "What is wrong?")), "asked")
    s.say(
        other.name,
        w.pick(
            (
                "I am new here, and I do not have any friends.",
                f"I lost my {reason_thing}, and now I have nothing to play with.",
                f"I want to {base}, but I have no one to play with.",
                "The other kids are playing, and I am too shy to ask them.",
            )
        ),
    )
    s.para()
    s.say(hero.name,
          w.pick(("You can play with me!", "Do you want to play with me?", "Let's be friends!")),
          w.pick(("said", "said with a big smile")))
    s.add(f"{other.name} smiled for the first time that day.")
    s.add(f"They {past} together.")
    s.add(w.pick(("They laughed and laughed.", "They had so much fun.", "Time went by very fast.")))
    s.add(f"{other.name} was not {w.pick(SAD_WORDS)} anymore, because now {other.he} had a friend.")
    s.para()
    s.add(f"When it was time to go home, {other.name} said, \"Thank you for playing with me, {hero.name}.\"")
    s.add(
        w.pick(
            (
                f"From that day on, {hero.name} and {other.name} were best friends.",
                f"After that, {hero.name} and {other.name} met at {place} every day.",
                f"{hero.name} told {hero.his} {rel.kind} all about {hero.his} new friend.",
            )
        )
    )
    if w.chance(0.5):
        s.add(w.pick(BEDTIME_MORALS))


FEARS = (
    # (what, challenge (base), challenge (past), why it is scary); a friend can show how only outdoors
    ("the big slide", "go down the big slide", "went down the big slide", "It was very tall."),
    ("the dark", "sleep with the light off", "slept with the light off", "The room looked strange at night."),
    ("the water", "swim in the lake", "swam in the lake", "The water looked deep and cold."),
    ("the big dog next door", "say hello to the big dog", "said hello to the big dog", "It barked very loudly."),
    ("thunder", "watch the storm from the window", "watched the storm from the window", "It was so loud."),
    ("the tall tree", "climb the tall tree", "climbed the tall tree", "The top was very high."),
    ("riding a bike", "ride a bike", "rode a bike", "What if {he} fell?"),
    ("the ocean waves", "jump over the waves", "jumped over the waves", "The waves were big and noisy."),
    ("singing in front of people",
     "sing at the school show",
     "sang at the school show",
     "So many people would be watching."),
    ("the high swing", "swing up high", "swung up high", "It went up so high."),
    ("the old bridge",
     "walk across the old bridge",
     "walked across the old bridge",
     "The bridge creaked with every step."),
    ("the big horse", "pet the big horse", "petted the big horse", "It was so much bigger than {him}."),
    ("the vacuum cleaner", "help vacuum the carpet", "helped vacuum the carpet", "It roared like a monster."),
    ("the deep end of the pool",
     "swim in the deep end",
     "swam in the deep end",
     "{He} could not touch the bottom there."),
    ("the haircut chair",
     "sit in the big chair for a haircut",
     "sat in the big chair for a haircut",
     "The scissors went snip, snip, right by {his} ears."),
    ("the escalator",
     "ride the escalator at the mall",
     "rode the escalator at the mall",
     "The moving stairs looked tricky."),
    ("bees",
     "walk through the flower garden",
     "walked through the flower garden",
     "The bees buzzed around every flower."),
)


def fear(w: Writer, s: Story) -> None:
    hero = w.hero()
    what, base, past, why = w.pick(FEARS)
    why = why.format(he=hero.he, He=hero.He, him=hero.him, his=hero.his)
    helper_is_friend = what not in ("the dark", "thunder") and w.chance(0.4)
    helper = w.friend_like(hero) if helper_is_friend else w.relative()

    s.add(w.opening(hero))
    s.add(w.trait(hero))
    s.add(f"But {hero.name} was afraid of {what}. {why}")
    s.para()
    s.add(f"{w.when()} {hero.name} wanted to {base}, but {hero.he} was too scared.")
    s.say(hero.name,
          w.pick(("What if I fall?", "What if something bad happens?", "I can't do it.", "I am too scared.")),
          w.pick(("said", "whispered")))
    if helper_is_friend:
        s.add(f"{hero.His} friend {helper.name} was there too.")
        s.add(f"{helper.name} {past} first.")
        s.say(helper.he, w.pick(("See? It is fun!", "Look, it is not scary at all!", "You can do it too!")))
    else:
        s.add(f"{hero.His} {helper.kind} held {hero.his} hand.")
        s.say(
            helper.name,
            w.pick(
                (
                    "It is okay to be scared. I will be right here with you.",
                    "Take a deep breath. You are braver than you think.",
                    "Let's try it together, one little step at a time.",
                )
            ),
        )
    s.para()
    s.add(w.pick((f"{hero.name} took a deep breath.",
                  f"{hero.name} counted to three.",
                  f"{hero.name} closed {hero.his} eyes for a moment.")))
    s.add(f"Then {hero.he} {past}.")
    s.add(w.pick(("It was not scary at all!", "It was fun!", f"It was much easier than {hero.he} thought!")))
    s.say(hero.name,
          w.pick(("I did it!", "I did it! I really did it!", "Can I do it again?")),
          w.pick(("shouted", "laughed", "said")))
    s.para()
    if helper_is_friend:
        s.add(f"{helper.name} clapped {helper.his} hands.")
    else:
        s.add(w.hug(helper, hero))
        s.say(helper.name, "I am so proud of you.")
    s.add(f"{hero.name} felt very proud of {hero.himself}.")
    s.add(
        w.pick(
            (
                f"After that day, {hero.name} was not afraid of {what} anymore.",
                "Sometimes the things that scare us are not so scary after all.",
                f"{hero.He} learned that being brave means trying even when you are scared.",
            )
        )
    )


def sharing(w: Writer, s: Story) -> None:
    hero = w.hero()
    friend = w.friend_like(hero)
    rel = w.relative()
    thing, soft = w.thing()

    s.add(
        w.pick(
            (
                f"{hero.name} and {friend.name} were good friends.",
                f"{hero.name} and {friend.name} lived next to each other and played together every day.",
                f"{w.opening(hero)} {hero.His} best friend was {a(friend.kind)} named {friend.name}.",
            )
        )
    )
    s.para()
    s.add(
        w.pick(
            (
                f"{w.when()} {friend.name} came to play at {hero.name}'s house.",
                f"{w.when()} {hero.name} and {friend.name} were playing in the garden.",
                f"{w.when()} the two friends were playing together.",
            )
        )
    )
    s.add(f"They found {a(thing)} {w.pick(('in the toy box', 'under the table', 'on the grass', 'in a big box'))}.")
    s.say(hero.name, "I want to play with it!", "said")
    s.say(friend.name, "No, I want it!", "said")
    s.add(w.pick(("They both pulled and pulled.",
                  f"{hero.name} pulled one way, and {friend.name} pulled the other way.")))
    broke = w.chance(0.5)
    if broke:
        s.add(f"Then, {'rip' if soft else 'crack'}! The {thing} {'tore' if soft else 'broke'}.")
        s.add(f"Now nobody could play with it. {hero.name} and {friend.name} both felt {w.pick(SAD_WORDS)}.")
    else:
        s.add(f"They were so loud that {hero.name}'s {rel.kind} came to see what was wrong.")
    s.para()
    if broke:
        s.add(f"{hero.name}'s {rel.kind} came in and saw the {thing}.")
        s.say(rel.name, "When we fight, nobody wins.")
        mend = w.pick(("a needle and thread", "some tape") if soft else ("some glue", "some tape"))
        s.add(f"{rel.name} helped them fix the {thing} with {mend}.")
        s.say(rel.name, "Now, what if you take turns?")
    else:
        s.say(rel.name, w.pick(("What if you take turns?", "I know a good idea. You can share it.")))
    s.add(f"{hero.name} and {friend.name} looked at each other.")
    s.say(hero.name, w.pick((f"I am sorry, {friend.name}.", f"You can go first, {friend.name}.")))
    s.say(friend.name, w.pick(("I am sorry too.", "Thank you! Then it is your turn.")))
    s.para()
    s.add(f"First, {friend.name} played with the {thing}. Then {hero.name} had a turn.")
    s.add(w.pick(("Soon they were laughing again.",
                  "They played until the sun went down.",
                  "They even made up a new game together.")))
    s.add(
        w.pick(
            (
                "They learned that sharing makes playing more fun.",
                "Sharing made everyone happy.",
                f"{hero.name} and {friend.name} learned that friends are more important than toys.",
            )
        )
    )


ANIMALS_IN_TROUBLE = (
    # (animal, trouble, what they do, how it ends)
    (
        "bird", "had a hurt wing and could not fly",
        "put the bird in a soft box with some seeds and water",
        "After a few days, the bird's wing was better. It flapped its wings and flew up into the blue sky.",
    ),
    (
        "kitten", "was stuck high up in a tree",
        "got a ladder, and the kitten jumped down into their arms",
        "The kitten purred and rubbed its head on their hands.",
    ),
    (
        "puppy", "was lost and could not find its way home",
        "read the name on its collar and walked it back to its house",
        "The puppy's family was so glad to see it. The puppy wagged its tail and barked with joy.",
    ),
    (
        "turtle", "was stuck on its back and could not turn over",
        "gently turned the turtle over",
        "The turtle slowly walked back to the pond and slid into the water.",
    ),
    (
        "duckling", "had lost its mother",
        "followed the sound of quacking down to the pond",
        "There was the mother duck! The little duckling swam to her as fast as it could.",
    ),
    (
        "butterfly", "was caught in a spider web",
        "carefully pulled the sticky web away from its wings",
        "The butterfly flew away and danced over the flowers.",
    ),
    (
        "hedgehog", "was cold and hungry in the snow",
        "made it a warm bed of leaves and gave it some food",
        "The next morning, the hedgehog was warm and full, and it waddled off into the garden.",
    ),
    (
        "squirrel", "had its tail caught under a fallen branch",
        "lifted the heavy branch together, very carefully",
        "The squirrel shook its bushy tail and raced up the nearest tree.",
    ),
    (
        "baby owl", "had fallen out of its nest",
        "put on thick gloves and lifted the owl back into its nest",
        "The mother owl came back and hooted softly to her baby.",
    ),
    (
        "goldfish", "had jumped out of the little pond and was flopping on the grass",
        "scooped it up with wet hands and put it back in the water",
        "The goldfish swam around in happy circles.",
    ),
    (
        "lamb", "had squeezed through the fence and could not get back to the flock",
        "opened the gate and led the lamb back to the field",
        "The lamb ran to its mother and said baa, baa.",
    ),
    (
        "frog", "was stuck in an empty bucket",
        "tipped the bucket over very slowly",
        "The frog hopped out, said ribbit, and jumped back into the pond.",
    ),
)


def help_animal(w: Writer, s: Story) -> None:
    hero = w.hero()
    rel = w.relative()
    animal, trouble, fix, recovery = w.pick(ANIMALS_IN_TROUBLE)
    where = w.pick(("in the garden",
                    "near the pond",
                    "in the park",
                    "by the old fence",
                    "on the way home",
                    "in the woods"))

    s.add(w.opening(hero))
    s.add(w.trait(hero))
    s.para()
    s.add(f"{w.when()} {hero.name} was walking {where} when {hero.he} heard a small sound.")
    spot = w.pick(("around", "behind a bush", "under a tree", "near the path"))
    s.add(f"{hero.He} looked {spot} and saw a little {animal}.")
    s.add(f"The {animal} {trouble}.")
    s.say(hero.name, f"Oh no, poor little {animal}!", w.pick(("said", "cried")))
    s.para()
    s.add(f"{hero.He} ran to get {hero.his} {rel.kind}.")
    s.say(hero.name, w.pick(("We have to help it!", f"Please come quick! A {animal} needs help!")))
    s.add(f"{rel.name} came right away.")
    s.add(f"Together, they {fix}.")
    s.add(w.pick((f"{hero.name} was very gentle.",
                  f"{hero.name} talked softly so the {animal} would not be scared.",
                  None)))
    s.para()
    s.add(recovery)
    s.add(w.pick((f"{hero.name} waved goodbye.",
                  f"{hero.name} smiled and waved.",
                  f"{hero.name} clapped {hero.his} hands.")))
    s.add(
        w.pick(
            (
                f"{hero.He} felt warm and happy inside because {hero.he} had helped.",
                f"{rel.name} said, \"You did a good thing today, {hero.name}.\"",
                f"{hero.name} was proud because {hero.he} had been kind to a little {animal}.",
            )
        )
    )


GIFTS = (
    # (gift, steps done, what goes wrong, how it is fixed)
    (
        "cake",
        ("mixed flour, eggs and sugar in a big bowl", "put the cake in the oven", "put pink frosting on top"),
        "the bowl tipped over and flour went everywhere",
        "they laughed, cleaned it up and started again",
    ),
    (
        "card",
        ("folded a big piece of paper", "drew a big {color} heart on the front", "wrote a kind message inside"),
        "a drop of water fell on the paint",
        "{name} turned the drop into a little flower",
    ),
    (
        "plate of cookies",
        ("mixed the butter and sugar",
         "rolled the dough into little balls",
         "baked the cookies until they were golden"),
        "the dog jumped up and ate one cookie",
        "they laughed, because there were still plenty of cookies left",
    ),
    (
        "necklace",
        ("found some bright beads", "put the beads on a string one by one", "tied a knot at the end"),
        "the string broke and the beads rolled all over the floor",
        "{name} picked up every bead and started again",
    ),
    (
        "picture",
        ("got out {his} crayons", "drew a big sun and a little house", "drew the whole family holding hands"),
        "the {color} crayon broke in two",
        "{name} used both little pieces",
    ),
    (
        "bouquet of flowers",
        ("went out to the garden", "picked the prettiest flowers", "tied them with {a_color} ribbon"),
        "a bee flew out of one of the flowers",
        "{name} stayed very still until the bee flew away",
    ),
    (
        "scrapbook",
        ("glued photos onto the pages", "wrote a little story under each photo", "put shiny stickers on the cover"),
        "the glue got stuck on {his} fingers",
        "they washed {his} hands with warm water and soap",
    ),
    (
        "paper crown",
        ("cut out a crown from gold paper", "decorated it with buttons and glitter", "wrote a name on the front"),
        "the crown was much too small",
        "they taped on an extra strip of paper to make it bigger",
    ),
    (
        "pot of soup",
        ("washed the carrots", "cut the vegetables with some help", "cooked the soup slowly on the stove"),
        "the soup was too salty at first",
        "they added more water and a little more carrot",
    ),
)
OCCASIONS = (
    "it was {who}'s birthday",
    "{who} was sick in bed",
    "{who} had been feeling sad",
    "{who} had worked very hard all week",
)


def gift(w: Writer, s: Story) -> None:
    hero = w.hero()
    receiver = w.relative()
    helper = w.relative()
    while helper.name == receiver.name:
        helper = w.relative()
    item, steps, problem, fix = w.pick(GIFTS)
    color = w.pick(COLORS[:9])
    steps = tuple(step.format(his=hero.his, color=color, a_color=a(color)) for step in steps)
    problem = problem.format(color=color, his=hero.his)
    fix = fix.format(name=hero.name, his=hero.his)
    occasion = w.pick(OCCASIONS).format(who=receiver.name)

    s.add(w.opening(hero))
    s.add(w.trait(hero))
    s.para()
    s.add(f"{w.when()} {occasion}.")
    s.add(f"{hero.name} wanted to make {receiver.name} something special.")
    s.add(f"{hero.He} decided to make {a(item)}.")
    s.add(w.pick((f"{helper.name} said {helper.he} would help.",
                  f"{hero.He} asked {helper.name} to help, and {helper.name} said yes.")))
    s.para()
    s.add(f"First, they {steps[0]}.")
    s.add(f"But then {problem}!")
    s.say(hero.name, w.pick(("Oh no!", "Oh dear!", "Oops!")), "cried")
    s.say(helper.name, w.pick(("It's okay. Don't worry.",
                               "Don't worry. Everything will be fine.",
                               "Stay calm, and let's keep going.")))
    s.add(f"So {fix}.")
    s.add(f"Next, they {steps[1]}. At last, they {steps[2]}.")
    s.para()
    s.add(f"When {hero.name} gave {receiver.name} the {item}, {receiver.name} was so surprised.")
    s.say(receiver.name,
          w.pick(("This is the best present ever!", "Thank you! I love it!", "You made this for me? It is wonderful!")))
    s.add(w.hug(receiver, hero))
    s.add(
        w.pick(
            (
                f"{hero.name} learned that the best gifts are the ones you make with love.",
                f"{hero.name} felt proud, because {hero.he} had made {receiver.name} happy.",
                w.happy_end(hero),
            )
        )
    )


INDOOR_FUN = (
    ("build a fort with blankets and pillows", "built a big fort with blankets and pillows"),
    ("bake cookies", "baked cookies that smelled wonderful"),
    ("put on a puppet show", "put on a funny puppet show with old socks"),
    ("play a board game", "played a board game, and everyone laughed a lot"),
    ("read stories under a blanket", "read stories under a blanket with a flashlight"),
    ("paint pictures", "painted pictures of the sun and the sea"),
    ("have a tea party", "had a tea party with all the toys"),
    ("make paper airplanes", "made paper airplanes and flew them down the hall"),
    ("do a jigsaw puzzle", "did a jigsaw puzzle with a hundred pieces"),
    ("have an indoor picnic", "had an indoor picnic on the living room floor"),
    ("make a music band", "made a music band with pots, pans and wooden spoons"),
    ("play dress-up", "played dress-up with old hats, scarves and boots"),
)


def rainy_day(w: Writer, s: Story) -> None:
    hero = w.hero()
    rel = w.relative()
    place = w.pick(("the beach", "the park", "the zoo", "the lake", "the fair", "the farm", "the mountains"))
    base, past = w.pick(INDOOR_FUN)

    s.add(w.opening(hero))
    s.add(w.trait(hero))
    s.para()
    s.add(f"{hero.name} and {hero.his} {rel.kind} had a plan to go to {place} on Saturday.")
    s.add(w.pick((f"{hero.He} was so excited that {hero.he} could not sleep the night before.",
                  f"{hero.He} talked about it all week.")))
    weather = w.pick(("it was raining", "dark clouds covered the sky", "rain was falling hard on the window",
                      "there was a big storm outside"))
    s.add(f"But when {hero.he} woke up, {weather}.")
    s.add(f"{hero.name} felt {w.pick(('sad', 'grumpy', 'upset', 'disappointed'))}.")
    s.say(hero.name, f"Now we cannot go to {place}!", w.pick(("said", "cried")))
    s.para()
    s.say(rel.name,
          f"{w.pick(('We can still have fun inside.', 'I have an idea.', 'Rainy days can be fun too.'))} Let's {base}!")
    s.add(f"So they {past}.")
    s.add(w.pick((f"{hero.name} forgot all about the rain.",
                  f"{hero.name} laughed so much that {hero.his} tummy hurt.",
                  "The time went by very fast.")))
    s.para()
    s.add(w.pick(("Later, the rain stopped, and a big rainbow came out.",
                  "In the evening, the sun came out again.",
                  "Outside, the rain kept falling, but nobody minded.")))
    s.say(hero.name, "This was the best rainy day ever!")
    s.add(w.pick((f"{hero.He} learned that a day can be fun even when plans change.",
                  f"And next Saturday, they went to {place} after all.")))


RULES = (
    # (where, warning and why, what the hero did, what happened, how it was made better)
    (
        "at the pool", "Do not run near the pool. The floor is wet and slippery.",
        "ran to the water", "Then {he} slipped on the wet floor and hurt {his} knee.",
        "put a bandage on {his} knee",
    ),
    (
        "in the kitchen", "Do not climb on the shelf. It is not safe.",
        "climbed up the shelf to reach a toy", "Then the shelf shook, and a jar fell down and broke.",
        "swept up the pieces",
    ),
    (
        "in the kitchen", "Do not eat too many cookies. Too many sweets will give you a tummy ache.",
        "ate one cookie, then another, and then five more", "Soon {he} had a bad tummy ache.",
        "made {him} a cup of warm tea",
    ),
    (
        "at the store", "Stay close to me in the store. It is very big and busy.",
        "wandered off to look at the toys", "Soon {he} could not find {his} way back.",
        "found {him} by the toy shelf",
    ),
    (
        "in the living room", "Do not play ball in the house. Something might break.",
        "threw the ball high in the air", "The ball hit a lamp, and the lamp fell over.",
        "helped {him} put the lamp back",
    ),
    (
        "at the front door", "Put on your coat. It is cold outside.",
        "went outside without a coat", "Soon {he} started to shiver and sneeze.",
        "wrapped {him} in a warm blanket",
    ),
    (
        "in the park", "Do not jump in the mud. You are wearing your new clothes.",
        "jumped right into the biggest puddle of mud", "Mud went all over {his} new clothes.",
        "helped {him} wash the clothes",
    ),
    (
        "at the farm", "Do not feed the goats your sandwich. It is not good for them.",
        "held out {his} sandwich to a goat", "The goat ate the whole sandwich, and now {he} had no lunch.",
        "shared {rel_his} own lunch with {him}",
    ),
)


def disobey(w: Writer, s: Story) -> None:
    hero = w.hero()
    rel = w.relative()
    where, warning, did, happened, better = w.pick(RULES)
    fmt = dict(he=hero.he, him=hero.him, his=hero.his, rel_his=rel.his)
    did, happened, better = did.format(**fmt), cap(happened.format(**fmt)), better.format(**fmt)

    s.add(w.opening(hero))
    s.add(w.trait(hero))
    s.para()
    s.add(f"{w.when()} {hero.name} was {where} with {hero.his} {rel.kind}.")
    s.say(rel.name, warning)
    s.add(f"{hero.name} nodded. {w.pick(('But', 'But soon'))} {hero.he} forgot about the rule, and {hero.he} {did}.")
    s.add(happened)
    s.add(w.pick((f"{hero.name} began to cry.",
                  f"{hero.name} felt very sorry.",
                  f"{hero.name} did not feel good at all.")))
    s.para()
    s.add(f"{rel.name} came and {better}.")
    s.say(hero.name, w.pick(("I am sorry. I should have listened.", "I am sorry. Next time I will listen.")))
    s.say(rel.name, w.pick(("I know. Rules are there to keep you safe.",
                            "It's okay. We all make mistakes. Just remember next time.")))
    s.add(w.hug(rel, hero))
    s.para()
    s.add(
        w.pick(
            (
                f"From then on, {hero.name} always listened to {hero.his} {rel.kind}.",
                f"{hero.name} learned that it is important to listen.",
                f"After that day, {hero.name} remembered the rule every time.",
            )
        )
    )


def race(w: Writer, s: Story) -> None:
    hero = w.hero()
    friend = w.friend_like(hero)
    goal = w.pick(("the big oak tree",
                   "the old fence",
                   "the top of the hill",
                   "the red barn",
                   "the pond",
                   "the end of the path"))

    s.add(w.opening(hero))
    s.add(f"{hero.His} best friend was {a(friend.desc)} named {friend.name}.")
    s.add(w.pick(("They both loved to run.", "They liked to see who was faster.", "They played together every day.")))
    s.para()
    s.add(f"{w.when()} they decided to have a race to {goal}.")
    s.say("they", "Ready, set, go!", "shouted")
    s.add(f"{hero.name} ran as fast as {hero.he} could. {friend.name} ran fast too.")
    s.add(f"Suddenly, {friend.name} tripped over {w.pick(('a rock', 'a root', 'a stick', 'a log'))} and fell down.")
    s.say(friend.name, w.pick(("Ouch!", "Ow, my knee!", "Help!")), "cried")
    s.para()
    s.add(f"{hero.name} could have kept running to win the race.")
    s.add(f"But {hero.he} stopped and ran back to help {hero.his} friend.")
    s.say(hero.name, "Are you okay?", "asked")
    s.add(f"{hero.He} helped {friend.name} stand up.")
    s.add(f"Then they walked to {goal} together, side by side.")
    s.para()
    s.say(friend.name, w.pick(("You are a true friend.", "Thank you for coming back for me.")))
    s.add(w.pick(("They did not care who won.", "Nobody won the race, but they were both happy.")))
    s.add(w.pick(("Being a good friend is better than winning.", "A good friend always helps.", w.happy_end(hero))))


SEEDS = (
    # (seed, what grows, what they do with it)
    ("sunflower", "a tall yellow sunflower, taller than {him}", "Birds came to eat its seeds."),
    ("tomato", "a big plant full of red tomatoes", "They ate the tomatoes for dinner."),
    ("pumpkin", "a big round orange pumpkin", "They carved a happy face into it."),
    ("rose", "a beautiful red rose", "{He} gave the rose to {rel}."),
    ("bean", "a long green bean plant that climbed up a stick", "They cooked the beans for lunch."),
    ("carrot", "a row of crunchy orange carrots", "{He} shared them with {his} bunny."),
    ("strawberry", "a plant covered with sweet strawberries", "They ate the strawberries with cream."),
    ("apple", "a tiny apple tree with green leaves", "Every year, the little tree grew a bit bigger."),
    ("watermelon", "a huge striped watermelon", "They shared the sweet, juicy watermelon with the neighbors."),
    ("cucumber", "a vine full of cool green cucumbers", "They made a crunchy salad."),
    ("lavender", "a bush of purple lavender that smelled lovely", "Butterflies and bees came to visit every day."),
)


def garden(w: Writer, s: Story) -> None:
    hero = w.hero()
    rel = w.relative()
    seed, grows, after = w.pick(SEEDS)
    fmt = dict(he=hero.he, He=hero.He, him=hero.him, his=hero.his, rel=rel.name)
    grows, after = grows.format(**fmt), after.format(**fmt)

    s.add(w.opening(hero))
    s.add(w.trait(hero))
    s.para()
    s.add(f"{w.when()} {hero.his} {rel.kind} gave {hero.him} a small {seed} seed.")
    s.add(f"{hero.name} dug a little hole in the garden, put the seed inside and covered it with soil.")
    s.add(f"Then {hero.he} gave it some water.")
    s.para()
    s.add(f"The next day, {hero.name} ran outside to look. Nothing was there.")
    s.add(w.pick(("After three days, there was still nothing.", "A week went by, and still nothing grew.")))
    s.say(hero.name, "Why is it not growing?", "asked")
    s.say(rel.name, w.pick(("Plants need time, sun and water. You must be patient.",
                            "Good things take time. Keep watering it every day.")))
    s.para()
    more = w.pick(("", " and sang it little songs", " and told it stories"))
    s.add(f"So {hero.name} watered the seed every morning{more}.")
    s.add(f"Then one morning, {hero.he} saw a tiny green sprout!")
    s.say(hero.name, "It is growing!", "shouted")
    s.add(f"By the end of the summer, it had grown into {grows}.")
    s.add(after)
    s.add(w.pick((f"{hero.name} learned that good things take time.",
                  f"{hero.name} was glad {hero.he} had been patient.",
                  w.happy_end(hero))))


TRIPS = (
    # (place, three things they did (past), what went wrong, how it ended)
    (
        "the beach",
        ("built a big sandcastle", "looked for shells by the water", "splashed in the waves"),
        "a big wave came and washed the sandcastle away",
        "They laughed and built an even bigger one, far away from the water.",
    ),
    (
        "the zoo",
        ("saw a tall giraffe eating leaves", "watched the monkeys swing from tree to tree", "heard a lion roar"),
        "{his} {color} balloon slipped out of {his} hand and floated away",
        "{rel} got {him} a new balloon and tied it to {his} wrist, so it could not fly away.",
    ),
    (
        "the farm",
        ("fed the goats", "collected eggs from the hens", "rode on a big green tractor"),
        "a goat grabbed {his} hat and started to eat it",
        "Everyone laughed, and the farmer gave {him} a new hat.",
    ),
    (
        "the forest",
        ("had a picnic under a big tree", "looked for pine cones", "listened to the birds sing"),
        "a line of ants marched over to their sandwiches",
        "They moved the picnic to a big rock and left a few crumbs for the ants.",
    ),
    (
        "the lake",
        ("fed the ducks", "threw little stones into the water", "took a ride in a small boat"),
        "one of {his} shoes fell into the water",
        "{rel} used a long stick to fish the shoe out, and it dried in the sun.",
    ),
    (
        "the fair",
        ("rode on the merry-go-round", "ate sweet pink cotton candy", "won a prize at a game"),
        "{he} dropped {his} cotton candy on the ground",
        "{rel} shared {rel_his} cotton candy with {him}.",
    ),
    (
        "the aquarium",
        ("watched a shark swim past the glass",
         "saw jellyfish glowing in the dark",
         "touched a starfish in a little pool"),
        "{he} could not see the octopus because it was hiding",
        "They waited very quietly, and at last the octopus came out and waved one of its arms.",
    ),
    (
        "the museum",
        ("looked at the bones of a huge dinosaur",
         "saw paintings of ships and mountains",
         "stood inside a model of a spaceship"),
        "{he} got lost in a big room full of old statues",
        "A kind guard helped {him}, and soon {he} saw {rel} waving at {him}.",
    ),
    (
        "the market",
        ("smelled the fresh bread at the bakery stand", "tasted a juicy peach", "bought a bunch of sunflowers"),
        "the bag broke, and oranges rolled all over the ground",
        "Some kind people helped them pick up every orange.",
    ),
    (
        "the mountains",
        ("walked up a steep path", "saw a waterfall splashing over the rocks", "ate lunch on top of a big rock"),
        "{he} got a blister on {his} foot",
        "{rel} put a bandage on it, and they walked slowly the rest of the way.",
    ),
    (
        "the river",
        ("skipped stones across the water",
         "watched a family of beavers build a dam",
         "floated leaves like little boats"),
        "{his} hat blew off and landed in the water",
        "The hat floated to the bank, and {rel} picked it up with a stick.",
    ),
    (
        "the snowy hill",
        ("built a big snowman", "went down the hill on a sled", "made angels in the snow"),
        "{his} mitten got lost in the deep snow",
        "They dug and dug until they found it.",
    ),
)


def trip(w: Writer, s: Story) -> None:
    hero = w.hero()
    rel = w.relative()
    place, things, problem, ending = w.pick(TRIPS)
    fmt = dict(he=hero.he, him=hero.him, his=hero.his, rel=rel.name, rel_his=rel.his, color=w.pick(COLORS[:9]))
    problem, ending = problem.format(**fmt), cap(ending.format(**fmt))
    first, second, third = things

    s.add(w.opening(hero))
    s.add(w.trait(hero))
    s.para()
    s.add(f"{w.when()} {hero.name} went to {place} with {hero.his} {rel.kind}.")
    s.add(w.pick((f"{hero.He} was very excited.",
                  f"{hero.He} had never been there before.",
                  f"It was {hero.his} favorite place.")))
    s.add(f"First, they {first}. Then they {second}.")
    s.para()
    s.add(f"But then {problem}.")
    s.say(hero.name, w.pick(("Oh no!", "Come back!", "Oh dear!")), "cried")
    s.add(f"{hero.name} felt {w.pick(('sad', 'upset', 'worried'))} for a moment.")
    s.add(ending)
    s.para()
    s.add(f"After that, they {third}.")
    s.add(f"When it was time to go home, {hero.name} was tired but {w.pick(HAPPY_WORDS)}.")
    s.say(hero.name, f"Can we come back to {place} soon?", "asked")
    s.say(rel.name, w.pick(("Yes, we can.", "Of course!", "Maybe next week.")))


NEIGHBORS = (
    # (title and name, female)
    ("Mrs. Lee", True), ("Mr. Baker", False), ("Mrs. Patel", True), ("Mr. Stone", False), ("Miss Hill", True),
    ("Mr. Novak", False), ("Mrs. Garcia", True), ("Mr. Okafor", False), ("Mrs. Wood", True), ("Mr. Fisher", False),
    ("Miss Bell", True), ("Mr. Carter", False), ("Mrs. Moreno", True), ("Mr. Hughes", False), ("Mrs. Kowalski", True),
    ("Mr. Tanaka", False), ("Miss Rivera", True), ("Mr. Jensen", False), ("Mrs. Singh", True), ("Mr. Murphy", False),
    ("Mrs. Nguyen", True), ("Mr. Schmidt", False), ("Miss Dupont", True), ("Mr. Adams", False), ("Mrs. Cohen", True),
)


def neighbor(w: Writer) -> Char:
    name, female = w.pick(NEIGHBORS)
    return Char(name=name, kind="neighbor", female=female)


DREAMS = (
    # (where, how the hero gets there, who is met there (with "a"), its short name, what they do, what it looks like);
    # "where" starts with the preposition it takes ("on the moon").
    (
        "on the moon", "a shiny silver rocket zoomed {him} up past the clouds",
        "a friendly alien with three eyes", "alien", "bounced across the soft gray dust",
        "Far away, the Earth looked like a blue marble.",
    ),
    (
        "in a castle in the clouds", "a big white swan carried {him} up into the sky",
        "a kind giant with a long curly beard", "giant", "drank tea from cups as big as bathtubs",
        "The castle had a hundred towers, and every window sparkled.",
    ),
    (
        "at the bottom of the sea", "{he} dove into the waves and found that {he} could breathe under water",
        "a mermaid with a shimmering green tail", "mermaid", "swam with dolphins and a gentle old whale",
        "Bright fish and wavy seaweed were all around them.",
    ),
    (
        "in a land made of candy", "{he} walked through a door made of chocolate",
        "a little gingerbread man", "gingerbread man", "picked lollipop flowers and drank from a lemonade river",
        "The hills were made of ice cream, and the trees were made of cotton candy.",
    ),
    (
        "in a magic forest", "a glowing path appeared at the end of {his} bed",
        "a baby dragon who was afraid of the dark", "dragon", "hung tiny lanterns in the trees so the dragon felt safe",
        "The mushrooms glowed blue and purple, and the flowers whispered.",
    ),
    (
        "on a faraway planet", "{he} climbed into a spaceship shaped like a teapot",
        "a robot who loved to dance", "robot", "danced on rings of ice around the planet",
        "There were two suns in the sky, one orange and one pink.",
    ),
    (
        "in a jungle of talking animals", "a parrot called {his} name and flew {him} out of the window",
        "a wise old tortoise", "tortoise", "swung on vines and played drums with the monkeys",
        "The leaves were as big as umbrellas.",
    ),
    (
        "on the top of a rainbow", "{he} climbed up a rainbow as if it were a staircase",
        "a tiny fairy with sparkly wings", "fairy", "painted the clouds pink and gold",
        "From up there, the whole town looked like a toy village.",
    ),
    (
        "on an island full of treasure", "a pirate ship with purple sails picked {him} up",
        "a parrot who wore a tiny hat", "parrot", "followed an old map to a chest full of gold coins",
        "Palm trees swayed, and the sand was warm and white.",
    ),
)


def dream(w: Writer, s: Story) -> None:
    hero = w.hero()
    rel = w.relative()
    where, how, who, short, did, looks = w.pick(DREAMS)
    how = how.format(he=hero.he, him=hero.him, his=hero.his)

    s.add(w.opening(hero))
    s.add(w.trait(hero))
    s.para()
    s.add(w.pick((f"One night, {hero.name} could not fall asleep.",
                  f"One night, {hero.name} lay in bed and looked out at the stars.")))
    bedtime = w.pick((f"read {hero.him} a story", f"sang {hero.him} a soft song", f"tucked {hero.him} in"))
    s.add(f"{rel.name} {bedtime} and turned off the light.")
    s.say(rel.name,
          w.pick(("Sweet dreams.", "Good night, sleep tight.", "Close your eyes and dream of something nice.")))
    s.add(f"Soon, {hero.name} closed {hero.his} eyes and fell fast asleep.")
    s.para()
    s.add(f"In {hero.his} dream, {how}.")
    s.add(f"{hero.He} was {where}! {looks}")
    s.add(f"There, {hero.he} met {who}.")
    s.say(f"the {short}", f"Hello, {hero.name}. I have been waiting for you.")
    s.add(f"Together, they {did}.")
    s.add(w.pick((f"{hero.name} laughed and laughed.",
                  f"{hero.name} had never had so much fun.",
                  f"{hero.name} wished it would never end.")))
    s.para()
    s.add(f"Then {hero.he} heard a voice calling {hero.his} name.")
    s.add(f"{hero.name} opened {hero.his} eyes. It was morning, and {rel.name} was smiling at {hero.him}.")
    s.say(hero.name, "I had the most wonderful dream!")
    s.add(f"{hero.He} told {rel.name} all about {hero.his} dream and the {short}.")
    s.say(rel.name,
          w.pick(("Maybe tonight you can go back there.", "What a wonderful dream!", "You have a big imagination.")))


PARTY_GAMES = (
    "played musical chairs", "played hot potato", "did the freeze dance", "had a treasure hunt",
    "played duck, duck, goose", "had a sack race", "played Simon says", "played pin the tail on the donkey",
    "played hide and seek", "had a balloon race",
)
FLAVORS = ("chocolate", "strawberry", "vanilla", "lemon", "banana", "carrot", "coconut", "raspberry")
AGES = ("four", "five", "six", "seven", "eight")


def party(w: Writer, s: Story) -> None:
    hero = w.hero()
    first = w.friend_like(hero)
    second = w.friend_like(hero)
    while second.name == first.name:
        second = w.friend_like(hero)
    rel = w.relative()
    age = w.pick(AGES)
    game_one, game_two = w.rng.sample(PARTY_GAMES, 2)
    present_one, _ = w.thing()
    present_two, _ = w.thing()

    s.add(w.opening(hero))
    s.add(f"Today, {hero.name} was turning {age} years old, and {hero.he} was having a birthday party.")
    s.para()
    s.add(f"{rel.name} hung {w.pick(COLORS[:9])} balloons and paper streamers all around the room.")
    s.add(f"On the table, there was a big {w.pick(FLAVORS)} cake with {age} candles.")
    s.add(f"Soon, the doorbell rang. {first.name} and {second.name} were at the door with presents.")
    s.add(f"They {game_one}, and then they {game_two}.")
    trouble = w.pick(("lost", "pop", "cake"))
    if trouble == "lost":
        s.add(f"{second.name} did not win any of the games and sat down in a corner.")
        s.say(hero.name, "Let's play a game where everybody wins!")
        s.add(f"So they all held hands and danced in a circle. Soon {second.name} was smiling again.")
    elif trouble == "pop":
        s.add(f"Suddenly, a balloon popped with a loud bang! {first.name} got scared and started to cry.")
        s.add(f"{hero.name} gave {first.name} {hero.his} own balloon.")
        s.say(hero.name, "Here, you can have this one.")
        s.say(first.name, "Thank you!")
    else:
        s.add("Then the dog ran in and jumped on the table. The cake fell on the floor!")
        s.add(f"{hero.name} almost cried, but {rel.name} had an idea.")
        s.say(rel.name, "We still have ice cream. We can put the candles in the ice cream!")
        s.add("Everyone laughed, because it was the funniest birthday cake they had ever seen.")
    s.para()
    s.add("Then it was time for the candles. Everyone sang \"Happy Birthday.\"")
    s.add(f"{hero.name} closed {hero.his} eyes, made a wish and blew out all {age} candles.")
    s.add(f"{first.name} gave {hero.him} {a(present_one)}, and {second.name} gave {hero.him} {a(present_two)}.")
    s.para()
    s.add(f"That night, {hero.name} said, \"This was the best birthday ever!\"")
    s.add(w.pick((f"{hero.He} fell asleep holding the {present_one} from {first.name}.",
                  f"{hero.He} wished every day could be {hero.his} birthday.",
                  w.happy_end(hero))))


TEACHERS = (
    ("Miss Brown", True), ("Mr. Green", False), ("Mrs. Lopez", True), ("Mr. Evans", False), ("Miss Park", True),
    ("Mr. Bianchi", False), ("Mrs. Ahmed", True), ("Mr. Walker", False), ("Miss Ono", True), ("Mr. Popov", False),
    ("Mrs. Young", True), ("Mr. Reyes", False), ("Miss Turner", True), ("Mr. Mensah", False), ("Mrs. Dubois", True),
)
LESSONS = (
    "learned the letters A, B and C", "counted all the way to twenty", "sang a song about the days of the week",
    "painted pictures of their families", "listened to a story about a brave little mouse",
    "learned the names of shapes, like circles, squares and triangles", "planted beans in paper cups",
    "wrote their names in big letters", "played a game with numbers", "learned a song about the rain",
    "made masks out of paper plates", "looked at leaves with a magnifying glass",
)
LUNCHES = (
    "a peanut butter sandwich", "an apple and some crackers", "rice and vegetables", "a cheese sandwich",
    "noodles with sauce", "grapes and a blueberry muffin", "a banana and some yogurt", "carrot sticks and hummus",
    "little dumplings", "a tortilla with beans", "a boiled egg and some toast", "pasta salad", "a pear and some nuts",
)


def school(w: Writer, s: Story) -> None:
    hero = w.child()
    rel = w.relative()
    teacher_name, teacher_female = w.pick(TEACHERS)
    teacher = Char(name=teacher_name, kind="teacher", female=teacher_female)
    friend = w.child((hero.name,))
    lesson_one, lesson_two = w.rng.sample(LESSONS, 2)
    base, past = w.pick(ACTIVITIES)

    s.add(w.opening(hero))
    s.add(f"Today was {hero.his} first day at school.")
    new_thing = w.pick(("backpack", "lunchbox", "pair of shoes", "pencil case"))
    feeling = w.pick(("nervous", "shy", "a little scared"))
    s.add(f"{hero.He} had a new {new_thing}, but {hero.he} felt {feeling}.")
    s.say(hero.name,
          w.pick(("What if nobody likes me?", "What if I get lost?", "What if I do not know anything?")),
          "asked")
    s.say(rel.name, "Everyone feels that way on the first day. You will do great.")
    s.para()
    walls = w.pick(("colorful pictures", "letters and numbers", "paper birds", "drawings of animals"))
    s.add(f"The classroom was big and bright, with {walls} on the walls.")
    look = w.pick(("a warm smile", "round glasses", "a soft voice", "a yellow sweater"))
    s.add(f"The teacher was {teacher.name}. {teacher.He} had {look}.")
    s.say(teacher.name, "Welcome, everyone! I am so happy you are here.")
    s.add(f"First, they {lesson_one}. Then they {lesson_two}.")
    s.para()
    s.add(f"At lunch, {hero.name} sat next to {a(friend.desc)} named {friend.name}.")
    s.add(f"{friend.name} had {w.pick(LUNCHES)}, and {hero.name} had {w.pick(LUNCHES)}.")
    s.add(w.pick(("They shared their food and talked about their pets.",
                  f"{friend.name} told a funny joke, and {hero.name} laughed so hard.",
                  f"They found out that they both liked to {base}.")))
    s.add(f"After lunch, they {past} together.")
    s.para()
    s.add(f"When {rel.name} came to pick {hero.him} up, {hero.name} ran to {rel.him}.")
    s.say(rel.name, "How was school?", "asked")
    s.say(hero.name, f"It was great! I made a new friend, and {teacher.name} is so nice.")
    s.add(f"{hero.He} could not wait to go back the next day.")


CREATURES = (
    # (the little one, where it was found, how it was cared for, the change, how long, what came out, the ending)
    (
        "caterpillar", "a fuzzy green caterpillar on a leaf", "gave it fresh leaves every day",
        "the caterpillar made a cocoon and hung very still", "two weeks",
        "a beautiful butterfly with orange and black wings came out",
        "The butterfly opened its wings and flew away into the garden.",
    ),
    (
        "tadpole", "a tiny black tadpole in the pond", "kept it in a big jar of pond water",
        "the tadpole grew two back legs, then two front legs, and its tail got shorter", "a few weeks",
        "it had turned into a little green frog",
        "{name} carried the frog back to the pond, and it hopped away with a splash.",
    ),
    (
        "egg", "a small brown egg at the farm", "kept it warm under a lamp",
        "the egg began to wiggle and crack", "three weeks", "a fluffy yellow chick poked its head out",
        "The chick said, \"Peep, peep!\" and followed {name} everywhere.",
    ),
    (
        "acorn", "an acorn under the big oak tree", "planted it in a pot and watered it",
        "a tiny green shoot came up, and then two little leaves", "many weeks",
        "it had become a baby oak tree",
        "{name} planted the little tree in the park, so it could grow big and strong.",
    ),
)


def nature(w: Writer, s: Story) -> None:
    hero = w.hero()
    rel = w.relative()
    little, found, care, change, how_long, result, ending = w.pick(CREATURES)
    ending = ending.format(name=hero.name)

    s.add(w.opening(hero))
    s.add(f"{hero.He} was very curious about {w.pick(('bugs', 'plants', 'animals', 'everything outside'))}.")
    s.para()
    s.add(f"{w.when()} {hero.name} found {found}.")
    s.say(hero.name, "Can I take care of it?", "asked")
    s.say(rel.name, w.pick(("Yes, but you must be gentle.",
                            "Yes. Let's see what happens to it.",
                            "Of course. It will need your help.")))
    s.add(f"So {hero.name} {care}.")
    s.para()
    s.add(f"One morning, {change}.")
    s.say(hero.name, "Is something wrong?", "asked")
    s.say(rel.name, "No. It is changing. Just wait and see.")
    s.add(f"{hero.name} waited for {how_long}.")
    s.add(f"Then one day, {result}!")
    s.say(hero.name, w.pick(("Wow!", "Look at that!", "It is like magic!")), "shouted")
    s.para()
    s.add(ending)
    s.add(w.pick((f"{hero.name} learned that living things change as they grow.",
                  f"{hero.name} felt very proud.",
                  w.happy_end(hero))))


PROJECTS = (
    # (what, three things they need, where, what goes wrong, how they fix it, what they do with it)
    (
        "treehouse", ("old boards", "a hammer", "some nails"), "in the big tree in the backyard",
        "the floor wobbled, and one board fell down", "nailed two more boards under the floor to make it strong",
        "They had a snack in their new treehouse and watched the birds.",
    ),
    (
        "boat", ("an empty milk carton", "a straw", "a piece of cloth for a sail"), "by the stream",
        "the boat tipped over in the water", "put a few pebbles inside to keep it steady",
        "They watched the little boat sail down the stream.",
    ),
    (
        "snowman", ("lots of snow", "two stones for eyes", "a carrot for a nose"), "in the front yard",
        "the snowman's head rolled off", "packed the snow tighter and tried again",
        "They gave the snowman a scarf and a hat and named him Mr. Frosty.",
    ),
    (
        "robot", ("empty boxes", "bottle caps", "shiny foil"), "on the kitchen floor",
        "the robot's arm kept falling off", "used strong tape to hold it in place",
        "They put on a show where the robot danced and sang.",
    ),
    (
        "bird feeder", ("a pine cone", "some peanut butter", "a bag of seeds"), "on the back porch",
        "the seeds would not stick", "rolled the pine cone in more peanut butter first",
        "Soon, little birds came to eat from it every morning.",
    ),
    (
        "castle of blocks", ("wooden blocks", "paper flags", "a toy knight"), "in the living room",
        "the tall tower fell down with a crash", "made the bottom of the tower wider",
        "They put the toy knight on top and played kings and queens.",
    ),
    (
        "kite", ("two thin sticks", "a big sheet of paper", "a long string"), "in the garage",
        "the kite would not fly and kept crashing into the grass", "tied a long tail of ribbons to the bottom",
        "The kite flew high over the hill, and they took turns holding the string.",
    ),
    (
        "fort", ("big cardboard boxes", "old blankets", "a flashlight"), "in the backyard",
        "the wind blew the roof away", "put heavy stones on the corners of the blanket",
        "They sat inside their fort and told each other stories.",
    ),
)


def build_project(w: Writer, s: Story) -> None:
    hero = w.hero()
    friend = w.friend_like(hero)
    thing, needs, where, problem, fix, use = w.pick(PROJECTS)

    s.add(w.opening(hero))
    s.add(f"{hero.His} best friend was {a(friend.desc)} named {friend.name}.")
    s.para()
    s.add(f"{w.when()} {hero.name} and {friend.name} decided to build {a(thing)}.")
    s.add(f"They found {needs[0]}, {needs[1]} and {needs[2]}.")
    s.add(f"They worked {where} {w.pick(('all afternoon', 'all morning', 'for a long time'))}.")
    s.para()
    s.add(f"But then {problem}.")
    s.say(friend.name,
          w.pick(("Maybe we should give up.", "It is too hard. Let's stop.", "Oh no, it is ruined!")),
          w.pick(("said", "sighed")))
    s.say(hero.name, w.pick(("No, let's try again. We can do it if we work together.",
                             "Don't give up! I have an idea.",
                             "We can fix it. Let's try one more time.")))
    s.add(f"So they {fix}.")
    s.add(w.pick(("This time, it worked!", "And this time, everything held.", "It worked better than before!")))
    s.para()
    s.add(use)
    s.add(
        w.pick(
            (
                "Working together made the hard job easy.",
                f"{hero.name} and {friend.name} were proud, because they did not give up.",
                "They learned that when something goes wrong, you can always try again.",
            )
        )
    )


INSTRUMENTS = (
    "piano", "violin", "drums", "guitar", "flute", "trumpet", "xylophone", "recorder", "harp", "cello",
    "ukulele", "tambourine",
)
SHOWS = ("the school concert", "the spring show", "the talent show", "the summer fair", "the winter concert")


def music(w: Writer, s: Story) -> None:
    hero = w.hero()
    rel = w.relative()
    instrument = w.pick(INSTRUMENTS)
    show = w.pick(SHOWS)

    s.add(w.opening(hero))
    s.add(f"{hero.He} loved music, and {hero.his} favorite thing was to play the {instrument}.")
    s.para()
    s.add(f"{w.when()} {hero.name} found out that {hero.he} could play a song at {show}.")
    s.add(f"{hero.He} practiced every day after {w.pick(('school', 'lunch', 'breakfast', 'dinner'))}.")
    s.add(w.pick(("At first, the song sounded squeaky and wrong.",
                  "At first, it was very hard.",
                  f"Some days, {hero.he} wanted to stop.")))
    s.say(rel.name, "Keep going. A little practice every day makes a big difference.")
    s.add(f"Soon, the song sounded {w.pick(('better and better', 'sweet and smooth', 'just right'))}.")
    s.para()
    s.add(f"On the night of {show}, {hero.name}'s hands were shaking.")
    s.add(f"{hero.He} walked up on the stage and began to play.")
    s.add(f"In the middle of the song, {hero.he} played a wrong note.")
    s.add(f"{hero.He} wanted to run away. But then {hero.he} saw {rel.name} in the crowd, smiling and nodding.")
    s.add(f"So {hero.name} took a deep breath and kept playing until the very end.")
    s.para()
    s.add("Everyone clapped and cheered.")
    s.say(rel.name, "You were wonderful! I am so proud of you.")
    s.say(hero.name, "But I made a mistake.")
    s.say(rel.name, "Everybody makes mistakes. What matters is that you did not stop.")
    s.add(f"{hero.name} smiled.")
    s.add(w.pick((f"Next year, {hero.he} wanted to play two songs.", f"{hero.He} could not wait to play again.")))


CHORES = (
    # (what the neighbor needs, why they cannot (both in the neighbor's words), what the hero does)
    ("carry my heavy bags of groceries up the stairs",
     "my back is sore",
     "carried the bags up the stairs, one at a time"),
    ("rake the leaves in my yard", "I hurt my arm", "raked the leaves into a big pile, and then jumped right into it"),
    ("water my flowers",
     "I have to go away for a few days",
     "watered the flowers every morning until they were tall and bright"),
    (
        "find my little cat, Whiskers", "my eyes are not very good anymore",
        "looked up and down the street until {he} found the cat asleep in a flower pot",
    ),
    ("paint my old fence", "I am too tired", "painted the fence a bright new color, board by board"),
    ("clear the snow from my path",
     "I am afraid of slipping on the ice",
     "shoveled the snow until the path was clean and safe"),
    ("pick the apples from my tree", "I cannot climb the ladder", "picked a whole basket of red apples"),
)
TREATS = (
    "a glass of cold lemonade", "a warm apple pie", "a jar of homemade jam", "a plate of oatmeal cookies",
    "a bag of fresh cherries", "a slice of banana bread", "a cup of hot cocoa", "a bowl of strawberries",
)


def helpful_neighbor(w: Writer, s: Story) -> None:
    hero = w.hero()
    old = neighbor(w)
    rel = w.relative()
    need, why, did = w.pick(CHORES)
    did = did.format(he=hero.he)
    treat = w.pick(TREATS)

    s.add(w.opening(hero))
    s.add(f"Next door lived {old.name}, who was very old and very kind.")
    s.para()
    s.add(f"{w.when()} {hero.name} saw that {old.name} looked worried.")
    s.say(hero.name, f"What is wrong, {old.name}?", "asked")
    s.say(old.name, f"I need to {need}, but {why}.")
    s.say(hero.name, "I can help you!")
    s.add(f"{hero.He} asked {rel.name} if it was okay, and {rel.name} said yes.")
    s.para()
    s.add(f"So {hero.name} {did}.")
    s.add(w.pick(("It was hard work, but it was fun too.",
                  f"{hero.name} worked hard and did not give up.",
                  f"{old.name} watched and smiled.")))
    s.para()
    s.add(f"When {hero.name} was done, {old.name} gave {hero.him} {treat}.")
    s.say(old.name, w.pick(("Thank you. You are a very good helper.",
                            "I do not know what I would do without you.",
                            "You have a kind heart.")))
    s.add(
        w.pick(
            (
                f"{hero.name} felt warm inside. Helping others made {hero.him} happy.",
                f"After that, {hero.name} visited {old.name} every week.",
                f"{hero.name} learned that even a small helper can do big things.",
            )
        )
    )


SEASONS = (
    # (season, how it looks, how it sounds or smells, three things to do (past), what goes wrong, what they do, treat)
    (
        "spring", "the trees were covered with pink blossoms", "baby birds chirped in their nests",
        ("looked for the first tulips", "splashed in warm rain puddles", "flew a kite in the breezy sky"),
        "a sudden shower soaked them from head to toe",
        "They laughed and danced in the rain until it stopped.", "warm bowls of tomato soup",
    ),
    (
        "summer", "the days were long and hot", "the air smelled like fresh cut grass",
        ("ran through the sprinkler",
         "caught fireflies in a jar and then let them go",
         "ate cold slices of watermelon"),
        "the sun got so hot that {name} turned pink",
        "They put on big sun hats and played in the shade of a tree.", "tall glasses of pink lemonade",
    ),
    (
        "autumn", "the leaves turned red, orange and gold", "the wind blew them down like confetti",
        ("raked the leaves into a huge pile",
         "jumped into the pile with a loud crunch",
         "picked pumpkins in the patch"),
        "a gust of wind blew the whole pile of leaves away",
        "They chased the leaves all over the yard, laughing.", "warm apple cider and cinnamon muffins",
    ),
    (
        "winter", "soft white snowflakes fell from the sky", "long icicles hung from the roof",
        ("had a snowball fight", "made snow angels", "built a snow fort with thick walls"),
        "{name}'s boots filled up with snow, and {his} toes were freezing",
        "They went inside to warm up by the fireplace.", "mugs of hot cocoa with marshmallows",
    ),
)


def season(w: Writer, s: Story) -> None:
    hero = w.hero()
    friend = w.friend_like(hero)
    rel = w.relative()
    name, looks, sounds, things, problem, fix, treat = w.pick(SEASONS)
    problem = problem.format(name=hero.name, his=hero.his)
    first, second, third = things

    s.add(w.opening(hero))
    s.add(f"{hero.His} favorite time of the year was {name}.")
    s.para()
    s.add(f"When {name} came, {looks}, and {sounds}.")
    s.add(f"{w.when()} {hero.name} and {hero.his} friend {friend.name} went outside to play.")
    s.add(f"First, they {first}. Then they {second}.")
    s.para()
    s.add(f"But then {problem}.")
    s.say(friend.name, w.pick(("Oh no!", "Brrr!" if name == "winter" else "Oh my!", "What should we do now?")))
    s.add(fix)
    s.add(f"After that, they {third}.")
    s.para()
    s.add(f"Later, {hero.name}'s {rel.kind} called them in for {treat}.")
    s.say(hero.name, f"I love {name}!")
    s.say(friend.name, w.pick(("Me too!", f"So do I, {hero.name}.", "It is the best time of the year.")))


PLOTS = (
    lost_item, new_friend, fear, sharing, help_animal, gift, rainy_day, disobey, race, garden, trip, dream, party,
    school, nature, build_project, music, helpful_neighbor, season,
)


def make_story(rng: random.Random) -> str:
    writer = Writer(rng)
    story = Story(rng)
    writer.pick(PLOTS)(writer, story)
    return story.text()


def generate_splits(
    seed: int = DEFAULT_SEED, train_chars: int = TRAIN_CHARS, val_chars: int = VAL_CHARS
) -> tuple[list[str], list[str]]:
    """The validation stories, then the training stories, each list holding distinct stories none of the other has.

    Stories are drawn one after another from `random.Random(seed)`: the first ones fill the validation split up to
    `val_chars` characters, the next ones the training split up to `train_chars`; a story drawn before is skipped.
    """
    rng = random.Random(seed)
    seen: set[str] = set()
    splits: list[list[str]] = []
    for budget in (val_chars, train_chars):
        stories: list[str] = []
        size = 0
        while size < budget:
            story = make_story(rng)
            if story in seen:
                continue
            seen.add(story)
            stories.append(story)
            size += len(story) + len(STORY_SEPARATOR)
        splits.append(stories)
    val, train = splits
    return val, train


def join_stories(stories: Sequence[str]) -> str:
    return STORY_SEPARATOR.join(stories) + "\n"


def split_stories(text: str) -> list[str]:
    """The stories of a train.txt/val.txt text."""
    return [story for story in text.strip("\n").split(STORY_SEPARATOR) if story]


# ---- tokenizer -----------------------------------------------------------------------------------------------------
def train_tokenizer(stories: Sequence[str], vocab_size: int = VOCAB_SIZE):
    """A byte-level BPE `tokenizers.Tokenizer` with `vocab_size` entries in all, `<s>` (0) and `</s>` (1) among them.

    The post-processor puts `<s>` in front of every encoded text (as Llama's tokenizers do); `</s>` ends a story.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[BOS_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(stories, trainer=trainer, length=len(stories))
    bos_id, eos_id = tokenizer.token_to_id(BOS_TOKEN), tokenizer.token_to_id(EOS_TOKEN)
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS_TOKEN} $A",
                pair=f"{BOS_TOKEN} $A {BOS_TOKEN}:1 $B:1",
                special_tokens=[(BOS_TOKEN, bos_id), (EOS_TOKEN, eos_id)],
            ),
        ]
    )
    got = tokenizer.get_vocab_size(with_added_tokens=True)
    if got != vocab_size:
        raise RuntimeError(
            f"The trained tokenizer has {got} entries, not {vocab_size}: the corpus has too few distinct words for it."
        )
    return tokenizer


def save_tokenizer(tokenizer, folder: Path) -> None:
    """tokenizer.json, tokenizer_config.json and generation_config.json, as a Hugging Face repo has them."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"), pretty=True)
    bos_id, eos_id = tokenizer.token_to_id(BOS_TOKEN), tokenizer.token_to_id(EOS_TOKEN)
    added = {
        str(token_id): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for token_id, token in ((bos_id, BOS_TOKEN), (eos_id, EOS_TOKEN))
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": added,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
    }
    generation_config = {"bos_token_id": bos_id, "eos_token_id": eos_id}
    _write_json(folder / "tokenizer_config.json", tokenizer_config)
    _write_json(folder / "generation_config.json", generation_config)


def _write_json(path: Path, values: dict) -> None:
    path.write_text(json.dumps(values, indent=2) + "\n", encoding="utf-8")


# ---- the whole build -----------------------------------------------------------------------------------------------
def write_texts(out_dir: Path, seed: int = DEFAULT_SEED) -> tuple[list[str], list[str]]:
    """Generate the stories and write train.txt and val.txt; return (val stories, train stories)."""
    val, train = generate_splits(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, stories in (("train.txt", train), ("val.txt", val)):
        (out_dir / name).write_text(join_stories(stories), encoding="ascii", newline="\n")
    return val, train


def build(out_dir: Path = DEFAULT_OUT_DIR, seed: int = DEFAULT_SEED) -> dict:
    """Write train.txt, val.txt, tokenizer/ and README.md into `out_dir`; return the numbers of the build."""
    out_dir = Path(out_dir)
    val, train = write_texts(out_dir, seed)
    tokenizer = train_tokenizer(train)
    save_tokenizer(tokenizer, out_dir / "tokenizer")

    stats: dict = {"seed": seed, "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True)}
    for name, stories in (("train", train), ("val", val)):
        text = join_stories(stories)
        tokens = sum(len(e.ids) for e in tokenizer.encode_batch(list(stories), add_special_tokens=False))
        stats[name] = {
            "stories": len(stories),
            "bytes": len(text.encode("ascii")),
            "words": len(text.split()),
            "tokens": tokens,
            "chars_per_token": round(sum(len(s) for s in stories) / tokens, 2),
        }
    (out_dir / "README.md").write_text(_readme(stats), encoding="utf-8", newline="\n")
    return stats


def _readme(stats: dict) -> str:
    train, val = stats["train"], stats["val"]
    rows = "\n".join(
        f"| `{name}.txt` | {s['stories']:,} | {s['bytes']:,} | {s['words']:,} | {s['tokens']:,} "
        f"| {s['chars_per_token']:.2f} |"
        for name, s in (("train", train), ("val", val))
    )
    return f"""# The tiny corpus

Short, simple English children's stories for a first pretraining run on a laptop CPU, and a byte-level BPE tokenizer
trained on them. Every story was written by a program, `scripts/make_tiny_corpus.py`, from its own word lists
and sentence templates: no text was downloaded or copied. The files are part of litgpt and under its license,
Apache-2.0.

Regenerate them (byte for byte the same) with

```bash
python scripts/make_tiny_corpus.py --out_dir litgpt/data/tiny --seed {stats['seed']}
```

| file | stories | bytes | words | tokens | characters per token |
| --- | --- | --- | --- | --- | --- |
{rows}

(Tokens without `<s>` and `</s>`.)

- `train.txt`, `val.txt`: ASCII stories, one blank line between two stories and none inside a story (its paragraphs
  are separated by single newlines). No story is in both files. To train, split on blank lines and encode each story
  with `<s>` in front (the tokenizer adds it) and `</s>` at the end, so that the model learns where a story stops.
- `tokenizer/`: a Hugging Face tokenizer folder (`tokenizer.json`, `tokenizer_config.json`,
  `generation_config.json`) that `transformers.AutoTokenizer`, `tokenizers.Tokenizer.from_file` and
  `litgpt.tokenizer.Tokenizer` load. Byte-level BPE with {stats['vocab_size']} entries in all: `<s>` (id 0, BOS, added
  in front of every encoded text by the post-processor), `</s>` (id 1, EOS), the 256 byte symbols and the merges
  learned from `train.txt`. Any text can be encoded; text unlike the stories just takes more tokens.
"""


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out_dir", type=Path, default=DEFAULT_OUT_DIR, help="where to write (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="seed of the generator (default: %(default)s)")
    args = parser.parse_args(argv)
    stats = build(args.out_dir, args.seed)
    for name in ("train", "val"):
        s = stats[name]
        print(
            f"{name}.txt: {s['stories']} stories, {s['bytes']:,} bytes, {s['tokens']:,} tokens, "
            f"{s['chars_per_token']:.2f} characters per token"
        )
    print(f"tokenizer: {stats['vocab_size']} entries; written to {args.out_dir}")


if __name__ == "__main__":
    main()
